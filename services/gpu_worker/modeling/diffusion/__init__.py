"""Diffusion models (Cosmos 3): a text-conditioned denoising transformer and its VAE."""
