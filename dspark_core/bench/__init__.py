"""``dspark-core bench``: budget policies side by side on real prompts."""
