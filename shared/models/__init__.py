"""Model specs (the weight-free half of each model family)."""
