"""Encoder models (BERT-style embedding and scoring models)."""
