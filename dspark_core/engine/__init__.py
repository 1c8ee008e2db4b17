"""The decode engine: requests -> scheduler -> model runner -> step (propose, budget, verify, commit)."""
