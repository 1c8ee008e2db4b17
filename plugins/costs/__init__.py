"""Default cost models: additive and sps (each registered through its own entry point)."""
