"""Default model-family plugins."""
