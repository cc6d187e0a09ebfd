"""Vision towers and the vision-language models built on them (Gemma 3, Idefics3 /
SmolVLM, Qwen2.5-VL)."""
