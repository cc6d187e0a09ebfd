"""Model specs, the weight-free half of each model family: `base` (the `ModelSpec`
interface), one module per family, and `registry` (architecture -> spec)."""
