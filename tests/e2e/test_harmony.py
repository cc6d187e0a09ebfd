"""gpt-oss's harmony chat format through the real services, on a tiny random gpt-oss
checkpoint whose tokenizer has harmony's special tokens and whose chat template is gpt-oss's
own (llama.cpp keeps it: `models/templates/openai-gpt-oss-120b.jinja`, fetched with the
converter by scripts/fetch-llama-converter; the module skips without it):

- the prompt is the template's (tools, an earlier call and its result, the earlier turn's
  reasoning as `thinking`, `reasoning_effort` low): prompt_tokens equal transformers';
- a forced call (tool_choice required) comes back as `tool_calls` parsed from the
  commentary channel, an analysis message before it as `reasoning_content`, through the
  official openai client, streamed and not (the pieces join to the whole);
- a structured output is the final channel's body;
- a free greedy reply (random weights: channels where they fall) reads as transformers'
  greedy tokens do, decoded with their special tokens and read by the harmony reader.

Random weights do not reason: the grammar writes the channels, and a logit bias on `<|end|>`
keeps the analysis message one token long."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import httpx
import pytest

from services.api.answer import read_answer
from services.api.reasoning import HARMONY
from tests.llama_converter import chat_template
from tests.servers import MstarServer

TEMPLATE = chat_template("openai-gpt-oss-120b.jinja")
pytestmark = pytest.mark.skipif(TEMPLATE is None, reason="gpt-oss's chat template is not fetched "
                                "(scripts/fetch-llama-converter)")
SPECIALS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
                                               "required": ["city"]}}}]
HISTORY = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "reasoning_content": "I should look it up.",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    {"role": "user", "content": "And in Tokyo?"},
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer

    from tests.checkpoints import make_checkpoint

    path = make_checkpoint(tmp_path_factory.mktemp("harmony") / "gpt-oss", "gpt_oss", specials=SPECIALS,
                           max_position_embeddings=2048)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg.update(chat_template=TEMPLATE, eos_token="<|return|>", bos_token="<|startoftext|>")
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [tok.token_to_id("<|return|>"), tok.token_to_id("<|call|>")]}))
    return path


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    srv = MstarServer(str(folder), tmp_path_factory.mktemp("logs") / "harmony.log", "--num-kv-pages", "128",
                      env={"MSTAR_KV_DEBUG_ASSERTS": "1"}).start()
    yield srv
    srv.stop()


@cache
def _tokenizer(folder: Path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(folder)


def end_bias(folder: Path) -> dict[str, int]:
    return {str(_tokenizer(folder).convert_tokens_to_ids("<|end|>")): 100}


def test_the_prompt_is_the_templates(folder, server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "messages": HISTORY, "tools": TOOLS, "reasoning_effort": "low", "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    turns = [{**m, "thinking": m["reasoning_content"]} if "reasoning_content" in m else m for m in HISTORY]
    for m in turns:  # the template reads a call's arguments as an object (tojson), as parse_chat passes them
        for call in m.get("tool_calls", []):
            call["function"] = {**call["function"], "arguments": json.loads(call["function"]["arguments"])}
    want = _tokenizer(folder).apply_chat_template(turns, tools=TOOLS, reasoning_effort="low",
                                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    assert r.json()["usage"]["prompt_tokens"] == len(want)


def test_a_forced_call_comes_back_as_tool_calls(folder, server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    ask = dict(model="gpt-oss", messages=HISTORY[:2], tools=TOOLS, tool_choice="required", max_tokens=256,
               temperature=0, logit_bias=end_bias(folder))
    whole = client.chat.completions.create(**ask)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Tokyo")
    thinking = (choice.message.model_extra or {}).get("reasoning_content")
    assert thinking is None or (thinking and "<|" not in thinking)
    assert not choice.message.content
    chunks = list(client.chat.completions.create(**ask, stream=True))
    streamed = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or []) if c.choices]
    assert [(tc.function.name, tc.function.arguments) for tc in streamed] == [(call.function.name,
                                                                               call.function.arguments)]
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                        for c in chunks if c.choices)
    assert (reasoning or None) == thinking
    assert server.wait_pages_free() == 0


def test_a_structured_output_is_the_final_channels_body(folder, server):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "messages": HISTORY[:2], "max_tokens": 256, "temperature": 0, "logit_bias": end_bias(folder),
        "response_format": {"type": "json_schema", "json_schema": {"name": "yes_no", "schema": schema}}})
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert json.loads(message["content"])["answer"] in ("yes", "no")
    assert "<|" not in message["content"] and "<|" not in (message.get("reasoning_content") or "")


def test_a_free_reply_reads_as_transformers_tokens_do(folder, server):
    import torch
    import transformers

    tok = _tokenizer(folder)
    ids = tok.apply_chat_template(HISTORY[:2], add_generation_prompt=True, tokenize=True, return_dict=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    eos = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=eos,
                             pad_token_id=0)[0, len(ids):].tolist()
    shown = [t for t in out if t not in eos]  # an end-of-sequence token's text is never shown
    want = read_answer(tok.decode(shown, skip_special_tokens=False), HARMONY, None)
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "messages": HISTORY[:2], "max_tokens": 24, "temperature": 0})
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert (message.get("reasoning_content"), message["content"]) == (want.thinking, want.content)
    assert r.json()["usage"]["completion_tokens"] == len(out)
