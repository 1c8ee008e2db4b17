"""Training, calibration and evaluation of DSpark drafts (see docs/draft-training.md)."""
