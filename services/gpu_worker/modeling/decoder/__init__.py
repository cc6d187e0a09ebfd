"""Decoder-only LMs (Llama, Mistral, Qwen2/3, Qwen3-MoE, Gemma 2/3, Phi-3): the torch model,
the one-call C decode stack, decoder embedding models and the null model of the overhead
benches."""
