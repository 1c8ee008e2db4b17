"""Device kernels of the decode step (budget/allocate, pack, accept/commit)."""
