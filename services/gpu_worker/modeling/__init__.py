"""The torch models the gpu worker runs (one module per family); `registry.TORCH_MODELS`
says which spec class each one serves, `base` what the worker asks of every model."""
