"""Hybrid linear-attention families: full-attention layers over paged KV beside layers
whose per-request state is a fixed size (shared/specs/hybrid_lm.py)."""
