"""The OpenAI routes through the official `openai` client against a real server: models,
completions and chat (stream and not), usage, errors with their param, stop strings; greedy
/v1/completions equals /generate, and the chat prompt is transformers' apply_chat_template."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.reference import hf_ids, hf_tokenizer

GREEDY = {"temperature": 0}
NO_EOS = {"ignore_eos": True}
MESSAGES = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital of France."},
    {"role": "user", "content": "Numbers like 12345 and emoji 🎉?"},
]


def hf_chat_ids(ckpt, messages: list[dict]) -> list[int]:
    out = hf_tokenizer(str(ckpt)).apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def generate(server, **body) -> dict:
    r = httpx.post(server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


# ---- models --------------------------------------------------------------------------------


def test_models(client, model):
    models = client.models.list().data
    assert [m.id for m in models] == [model]
    assert models[0].object == "model" and models[0].owned_by == "mstar"
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.code == "model_not_found"


# ---- completions ---------------------------------------------------------------------------


def test_completion_matches_generate(client, model, llama_server, llama_ckpt):
    prompt = "The quick brown fox"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=12, extra_body={**GREEDY, **NO_EOS})
    plain = generate(llama_server, prompt=prompt, max_tokens=12, **GREEDY, **NO_EOS)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == model
    assert len(r.choices) == 1 and r.choices[0].index == 0
    assert r.choices[0].text == plain["text"] and r.choices[0].finish_reason == "length"
    n = len(hf_ids(llama_ckpt, prompt))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n, 12, n + 12)


def test_completion_token_prompt_and_echo(client, model, llama_server, llama_ckpt):
    ids = hf_ids(llama_ckpt, "Hello world!")
    r = client.completions.create(model=model, prompt=ids, max_tokens=6, echo=True, extra_body={**GREEDY, **NO_EOS})
    plain = generate(llama_server, input_ids=ids, max_tokens=6, **GREEDY, **NO_EOS)
    assert r.choices[0].text == "Hello world!" + plain["text"]
    assert r.usage.prompt_tokens == len(ids)


def test_completion_default_max_tokens_is_16(client, model):
    r = client.completions.create(model=model, prompt="Hello", extra_body={**GREEDY, **NO_EOS})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_completion_stream_with_usage(client, model):
    body = dict(model=model, prompt="Numbers like 12345 and emoji 🎉", max_tokens=20, extra_body={**GREEDY, **NO_EOS})
    plain = client.completions.create(**body)
    chunks = list(client.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == plain.choices[0].text
    assert all(c.usage is None for c in text_chunks)
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage == plain.usage
    assert len({c.id for c in chunks}) == 1


def test_completion_stream_without_usage(client, model):
    chunks = list(client.completions.create(model=model, prompt="Hello", max_tokens=5, stream=True,
                                            extra_body={**GREEDY, **NO_EOS}))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None and len(c.choices) == 1 for c in chunks)


def test_seed_makes_sampling_repeatable(client, model):
    body = dict(model=model, prompt="Once upon a time", max_tokens=12, temperature=1.0, top_p=0.9, seed=1234,
                extra_body={"top_k": 50, **NO_EOS})
    assert client.completions.create(**body).choices[0].text == client.completions.create(**body).choices[0].text


# ---- chat ----------------------------------------------------------------------------------


def test_chat_prompt_is_apply_chat_template(client, model, llama_server, llama_ckpt):
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=10,
                                       extra_body={**GREEDY, **NO_EOS})
    ids = hf_chat_ids(llama_ckpt, MESSAGES)
    assert r.usage.prompt_tokens == len(ids)
    # the same ids through /generate give the same greedy tokens: the prompt was those ids
    plain = generate(llama_server, input_ids=ids, max_tokens=10, **GREEDY, **NO_EOS)
    assert r.choices[0].message.content == plain["text"]
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.usage.completion_tokens == 10 and r.usage.total_tokens == len(ids) + 10


def test_chat_max_tokens_alias(client, model):
    r = client.chat.completions.create(model=model, messages=MESSAGES[1:2], max_tokens=3,
                                       extra_body={**GREEDY, **NO_EOS})
    assert r.usage.completion_tokens == 3


def test_output_neutral_fields_change_nothing(client, model):
    """What the openai client sends for OpenAI's own bookkeeping is accepted, and the answer
    is the one the same request gets without it."""
    msgs = [{"role": "user", "content": "Hello"}]
    plain = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, extra_body={**GREEDY, **NO_EOS})
    tagged = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, extra_body={**GREEDY, **NO_EOS},
                                            user="u-1", metadata={"run": "eval-7"}, store=True, service_tier="flex")
    assert tagged.choices[0].message.content == plain.choices[0].message.content
    assert tagged.usage.completion_tokens == plain.usage.completion_tokens == 6


def test_chat_content_parts(client, model, llama_ckpt):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}]
    r = client.chat.completions.create(model=model, messages=parts, max_tokens=2, extra_body={**GREEDY, **NO_EOS})
    assert r.usage.prompt_tokens == len(hf_chat_ids(llama_ckpt, [{"role": "user", "content": "Hello\nworld"}]))


def test_chat_stream_with_usage(client, model):
    body = dict(model=model, messages=MESSAGES, max_tokens=16, extra_body={**GREEDY, **NO_EOS})
    plain = client.chat.completions.create(**body)
    chunks = list(client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    body_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].delta.content or "" for c in body_chunks) == plain.choices[0].message.content
    assert body_chunks[-1].choices[0].finish_reason == "length" and body_chunks[-1].choices[0].delta.content is None
    assert usage_chunk.choices == [] and usage_chunk.usage == plain.usage


def test_chat_template_refusal_is_400(client, model, llama_server):
    r = httpx.post(llama_server.url + "/v1/chat/completions", json={"messages": [{"role": "tool", "content": "x"}]},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].tool_call_id"


# ---- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"n": 17}, "n"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}, "tools[0].function.parameters"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_object", "json_schema": 1}, "extra_body": {"guided_regex": "a"}},
         "guided_regex"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"extra_body": {"top_k": -5}}, "top_k"),
        ({"extra_body": {"bogus": 1}}, "bogus"),
    ],
)
def test_chat_refusals(client, model, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=MESSAGES[1:2], **kwargs)
    assert info.value.status_code == 400 and info.value.param == param
    assert info.value.body["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"n": 17}, "n"),
        ({"best_of": 2}, "best_of"),
        ({"logprobs": 21}, "logprobs"),
        ({"suffix": "x"}, "suffix"),
        ({"echo": True, "logprobs": -1}, "logprobs"),
        ({"prompt": ["a", ""]}, "prompt[1]"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ],
)
def test_completion_refusals(client, model, kwargs, param):
    body = {"prompt": "Hello", "max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, **body)
    assert info.value.param == param


def test_n_limit_message(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="Hello", n=17)
    assert info.value.body["message"] == "n must be an integer <= 16, got 17" and info.value.body["code"] is None


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES[1:2])
    assert info.value.code == "model_not_found" and info.value.param == "model"


def test_model_may_be_omitted(llama_server):
    r = httpx.post(llama_server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2, **GREEDY, **NO_EOS},
                   timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_length_limit_is_a_400_before_streaming(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        list(client.completions.create(model=model, prompt="Hello", max_tokens=100_000, stream=True))
    assert info.value.param == "max_tokens" or "max_tokens" in info.value.message


# ---- stop strings --------------------------------------------------------------------------


def _pick_stop(text: str) -> str:
    """A short piece from the middle of `text`, found first after its beginning."""
    for i in range(len(text) // 3, len(text) - 3):
        stop = text[i : i + 3]
        if stop.strip() and text.find(stop) >= 2:
            return stop
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_strings_openai(client, model, llama_server):
    prompt = "Hello world! Hello again,"
    body = dict(model=model, prompt=prompt, max_tokens=60, extra_body={**GREEDY, **NO_EOS})
    full = client.completions.create(**body).choices[0].text
    stop = _pick_stop(full)
    want = full[: full.find(stop)]

    r = client.completions.create(**body, stop=[stop, "never-appears-zzz"])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop" and r.choices[0].stop_reason == stop
    assert r.usage.completion_tokens < 60

    chunks = list(client.completions.create(**body, stop=stop, stream=True))
    pieces = [c.choices[0].text for c in chunks]
    assert "".join(pieces) == want and chunks[-1].choices[0].finish_reason == "stop"

    chat_full = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=60,
                                               extra_body={**GREEDY, **NO_EOS})
    text = chat_full.choices[0].message.content
    chat_stop = _pick_stop(text)
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=60, stop=chat_stop,
                                          extra_body={**GREEDY, **NO_EOS})
    assert chat.choices[0].message.content == text[: text.find(chat_stop)] and chat.choices[0].finish_reason == "stop"
    assert llama_server.wait_metric("mstar_requests_running", 0, timeout=2) == 0


def test_stop_strings_generate(llama_server):
    body = {"prompt": "The quick brown fox", "max_tokens": 60, **GREEDY, **NO_EOS}
    full = generate(llama_server, **body)
    stop = _pick_stop(full["text"])
    want = full["text"][: full["text"].find(stop)]
    r = generate(llama_server, **body, stop=stop)
    assert r["text"] == want and r["finish_reason"] == "stop"
    assert r["token_ids"] == full["token_ids"][: len(r["token_ids"])] and len(r["token_ids"]) < 60
    assert r["usage"]["completion_tokens"] == len(r["token_ids"])

    events = []
    with httpx.stream("POST", llama_server.url + "/generate", json={**body, "stop": [stop], "stream": True},
                      timeout=60) as s:
        assert s.status_code == 200
        events = [json.loads(line[5:]) for line in s.iter_lines() if line.startswith("data:")]
    deltas, done = events[:-1], events[-1]
    assert done["type"] == "done" and done["finish_reason"] == "stop" and done["text"] == want
    assert "".join(e["text"] for e in deltas) == want
    assert [t for e in deltas for t in e["token_ids"]] == done["token_ids"] == r["token_ids"]



async def test_stop_strings_websocket(llama_server):
    import asyncio

    import websockets

    body = {"prompt": "Hello world! Hello again,", "max_tokens": 60, **GREEDY, **NO_EOS}
    full = generate(llama_server, **body)["text"]
    stop = _pick_stop(full)
    url = llama_server.url.replace("http://", "ws://") + "/generate/ws"
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"type": "generate", "id": "s", **body, "stop": [stop]}))
        text = ""
        while (frame := json.loads(await asyncio.wait_for(ws.recv(), 30)))["type"] == "delta":
            text += frame["text"]
    assert frame["type"] == "done" and frame["finish_reason"] == "stop"
    assert text == frame["text"] == full[: full.find(stop)]

# ---- API key ---------------------------------------------------------------------------------


def test_api_key_from_env(llama_ckpt, tmp_path):
    """MSTAR_API_KEY through `mstar serve`: the openai client with the key works, without it
    401; probes stay open; a WebSocket handshake without the key is refused with 401."""
    import asyncio

    import websockets

    from tests.servers import MstarServer

    server = MstarServer(str(llama_ckpt), tmp_path / "log.txt", "--num-kv-pages", "64",
                         env={"MSTAR_API_KEY": "k-123"}).start()
    try:
        good = openai.OpenAI(base_url=server.url + "/v1", api_key="k-123", max_retries=0)
        r = good.completions.create(model=llama_ckpt.name, prompt="Hello", max_tokens=3,
                                    extra_body={**GREEDY, **NO_EOS})
        assert r.usage.completion_tokens == 3
        bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            bad.models.list()
        assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
        assert httpx.post(server.url + "/generate", json={"prompt": "x"}, timeout=10).status_code == 401
        assert httpx.get(server.url + "/metrics", timeout=10).status_code == 401
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        assert httpx.get(server.url + "/ready", timeout=10).status_code == 200

        async def ws_status(headers: dict[str, str] | None) -> int:
            try:
                async with websockets.connect(server.url.replace("http://", "ws://") + "/generate/ws",
                                              additional_headers=headers) as ws:
                    await ws.send(json.dumps({"type": "generate", "id": "a", "prompt": "hi", "max_tokens": 1}))
                    assert json.loads(await ws.recv())["id"] == "a"
                    return 101
            except websockets.InvalidStatus as exc:
                return exc.response.status_code

        assert asyncio.run(ws_status(None)) == 401
        assert asyncio.run(ws_status({"Authorization": "Bearer k-123"})) == 101
        metrics = httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer k-123"}, timeout=10)
        assert metrics.status_code == 200 and "mstar_kv_pages_total" in metrics.text
    finally:
        server.stop()
