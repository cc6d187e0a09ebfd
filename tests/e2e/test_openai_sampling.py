"""Sampling and outputs through the official `openai` client against a real server, checked
against transformers on the same checkpoint: logprobs (completions, chat, /generate) are a
float32 log-softmax of its logits within 1e-4, echo gives the prompt's logprobs, greedy's
token is its top alternative; repetition / presence / frequency penalties, logit_bias,
min_tokens and stop_token_ids give the tokens transformers' logits processors give; min_p;
n > 1 (seeded samples sharing the prompt's pages) and lists of prompts; /metrics token
counters equal the sum of usage."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from tests.reference import hf_greedy, hf_ids, hf_model

GREEDY = {"temperature": 0}
NO_EOS = {"ignore_eos": True}
PROMPT = "Hello world! Hello again, world."
TOL = 1e-4


def hf_logprobs(ckpt, ids: list[int]) -> torch.Tensor:
    """Row i: transformers' float32 log-softmax predicting ids[i + 1]."""
    with torch.no_grad():
        logits = hf_model(str(ckpt))(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)


def hf_processed_greedy(ckpt, ids: list[int], n: int, adjust) -> list[int]:
    """Greedy decoding on transformers' logits changed by `adjust(logits, generated)`."""
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = hf_model(str(ckpt))(torch.tensor([ids + out])).logits[0, -1].float()
        out.append(int(adjust(logits, out).argmax()))
    return out


def generate(server, **body) -> dict:
    r = httpx.post(server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


# ---- logprobs ------------------------------------------------------------------------------


def test_completion_logprobs_are_transformers_log_softmax(client, model, llama_ckpt):
    ids = hf_ids(llama_ckpt, PROMPT)
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, logprobs=5,
                                  extra_body={**GREEDY, **NO_EOS})
    out = hf_greedy(llama_ckpt, ids, 8)
    lp = hf_logprobs(llama_ckpt, ids + out)
    got = r.choices[0].logprobs
    assert len(got.tokens) == len(got.token_logprobs) == len(got.top_logprobs) == len(got.text_offset) == 8
    for i, tok in enumerate(out):
        row = lp[len(ids) - 1 + i]
        assert got.token_logprobs[i] == pytest.approx(float(row[tok]), abs=TOL)
        # keyed by token text, so two tokens with the same text (byte pieces) share an entry
        top = row.topk(5).values.tolist()
        assert 1 <= len(got.top_logprobs[i]) <= 5
        assert all(min(abs(v - w) for w in top) < TOL for v in got.top_logprobs[i].values())
        # greedy: the chosen token is the top alternative
        assert got.token_logprobs[i] == pytest.approx(top[0], abs=TOL) and int(row.argmax()) == tok
    # each token's text decoded alone (as vLLM), offsets counting those texts
    assert got.text_offset == [sum(len(t) for t in got.tokens[:i]) for i in range(8)]


def test_echo_logprobs_are_prompt_log_likelihood(client, model, llama_ckpt):
    """What evaluation harnesses send: echo, logprobs, max_tokens 1."""
    ids = hf_ids(llama_ckpt, PROMPT)
    r = client.completions.create(model=model, prompt=ids, max_tokens=1, echo=True, logprobs=1,
                                  extra_body={**GREEDY, **NO_EOS})
    got = r.choices[0].logprobs
    lp = hf_logprobs(llama_ckpt, ids)
    assert len(got.token_logprobs) == len(ids) + 1
    assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
    want = [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert got.token_logprobs[1 : len(ids)] == pytest.approx(want, abs=TOL)
    assert all(1 <= len(t) <= 2 for t in got.top_logprobs[1:])
    assert "".join(got.tokens[: len(ids)]) == r.choices[0].text[: len("".join(got.tokens[: len(ids)]))]


def test_batched_log_likelihood_as_evaluation_harnesses_ask(client, model, llama_ckpt):
    """lm-eval's local-completions loglikelihood: a batch of token prompts, echo, logprobs
    1, max_tokens 1; it sums token_logprobs over the continuation and checks greediness on
    top_logprobs by token text."""
    context = hf_ids(llama_ckpt, "The capital of France is")
    batch = [context + hf_ids(llama_ckpt, " Paris"), context + hf_ids(llama_ckpt, " a city by the river")]
    r = client.completions.create(model=model, prompt=batch, max_tokens=1, echo=True, logprobs=1, temperature=0,
                                  extra_body=NO_EOS)
    assert [c.index for c in r.choices] == [0, 1]
    for ids, choice in zip(batch, r.choices):
        lp = hf_logprobs(llama_ckpt, ids)
        got = choice.logprobs.token_logprobs[len(context) : len(ids)]
        want = [float(lp[i - 1, ids[i]]) for i in range(len(context), len(ids))]
        assert sum(got) == pytest.approx(sum(want), abs=len(want) * TOL)
        tops = choice.logprobs.top_logprobs[len(context) : len(ids)]
        toks = choice.logprobs.tokens[len(context) : len(ids)]
        greedy = all(t == max(top, key=top.get) for t, top in zip(toks, tops))
        assert greedy == all(int(lp[i - 1].argmax()) == ids[i] for i in range(len(context), len(ids)))


def test_prompt_logprobs_alone_is_vllms_field(llama_server, llama_ckpt):
    ids = hf_ids(llama_ckpt, PROMPT)
    r = httpx.post(llama_server.url + "/v1/completions", json={"prompt": ids, "max_tokens": 2, "prompt_logprobs": 2,
                                                                 **GREEDY, **NO_EOS}, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = hf_logprobs(llama_ckpt, ids)
    got = choice["prompt_logprobs"]
    assert choice["logprobs"] is None and got[0] is None and len(got) == len(ids)
    for i in range(1, len(ids)):
        own = got[i][str(ids[i])]
        assert own["logprob"] == pytest.approx(float(lp[i - 1, ids[i]]), abs=TOL)
        assert own["rank"] == int((lp[i - 1] > lp[i - 1, ids[i]]).sum()) + 1
        top = lp[i - 1].topk(2)
        assert {int(t) for t in got[i]} == {ids[i], *top.indices.tolist()}
    plain = httpx.post(llama_server.url + "/v1/completions", json={"prompt": ids, "max_tokens": 2, **GREEDY},
                       timeout=60).json()["choices"][0]
    assert "prompt_logprobs" not in plain


def test_echo_logprobs_stream_equal_json(client, model, llama_ckpt):
    body = dict(model=model, prompt=PROMPT, max_tokens=4, echo=True, logprobs=2, extra_body={**GREEDY, **NO_EOS})
    plain = client.completions.create(**body).choices[0]
    chunks = list(client.completions.create(**body, stream=True))
    lps = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert "".join(c.choices[0].text for c in chunks) == plain.text
    assert [v for lp in lps for v in lp.token_logprobs] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-5)
    assert [t for lp in lps for t in lp.tokens] == plain.logprobs.tokens


def test_chat_logprobs_and_top_logprobs(client, model):
    msgs = [{"role": "user", "content": "Say hello"}]
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, logprobs=True, top_logprobs=3,
                                       extra_body={**GREEDY, **NO_EOS})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for c in content:
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token
        assert c.logprob == pytest.approx(c.top_logprobs[0].logprob) and c.bytes == list(c.token.encode())
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
    stream = list(client.chat.completions.create(model=model, messages=msgs, max_tokens=6, logprobs=True,
                                                 top_logprobs=3, stream=True, extra_body={**GREEDY, **NO_EOS}))
    streamed = [c for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-5)
    plain = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, extra_body={**GREEDY, **NO_EOS})
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == r.choices[0].message.content


def test_generate_logprobs(llama_server, llama_ckpt):
    ids = hf_ids(llama_ckpt, PROMPT)
    r = generate(llama_server, input_ids=ids, max_tokens=5, logprobs=2, prompt_logprobs=0, **GREEDY, **NO_EOS)
    lp = hf_logprobs(llama_ckpt, ids + r["token_ids"])
    assert [e["token_id"] for e in r["logprobs"]] == r["token_ids"]
    for i, e in enumerate(r["logprobs"]):
        assert e["rank"] == 1 and e["top_logprobs"][0]["token_id"] == e["token_id"] and len(e["top_logprobs"]) == 2
        assert e["logprob"] == pytest.approx(float(lp[len(ids) - 1 + i, e["token_id"]]), abs=TOL)
    prompt = r["prompt_logprobs"]
    assert prompt[0] is None and [e["token_id"] for e in prompt[1:]] == ids[1:]
    assert [e["logprob"] for e in prompt[1:]] == pytest.approx([float(lp[i - 1, ids[i]]) for i in range(1, len(ids))],
                                                               abs=TOL)
    plain = generate(llama_server, input_ids=ids, max_tokens=5, **GREEDY, **NO_EOS)
    assert "logprobs" not in plain and plain["token_ids"] == r["token_ids"]


async def test_websocket_logprobs(llama_server, llama_ckpt):
    import asyncio
    import json

    import websockets

    ids = hf_ids(llama_ckpt, PROMPT)
    plain = generate(llama_server, input_ids=ids, max_tokens=4, logprobs=1, **GREEDY, **NO_EOS)
    url = llama_server.url.replace("http://", "ws://") + "/generate/ws"
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"type": "generate", "id": "w", "input_ids": ids, "max_tokens": 4, "logprobs": 1,
                                  "stream": True, **GREEDY, **NO_EOS}))
        deltas = []
        while (frame := json.loads(await asyncio.wait_for(ws.recv(), 30)))["type"] == "delta":
            deltas.append(frame)
    streamed = [e for d in deltas for e in d["logprobs"]]
    assert frame["type"] == "done" and frame["logprobs"] == streamed and len(streamed) == 4
    assert [e["token_id"] for e in streamed] == plain["token_ids"]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in plain["logprobs"]], abs=1e-5)


# ---- logits processors ---------------------------------------------------------------------


def test_repetition_penalty_is_transformers(client, model, llama_ckpt):
    from transformers import RepetitionPenaltyLogitsProcessor

    ids = hf_ids(llama_ckpt, PROMPT)
    r = client.completions.create(model=model, prompt=ids, max_tokens=12, logprobs=0,
                                  extra_body={**GREEDY, **NO_EOS, "repetition_penalty": 0.3})
    proc = RepetitionPenaltyLogitsProcessor(0.3)
    want = hf_processed_greedy(llama_ckpt, ids, 12, lambda x, out: proc(torch.tensor([ids + out]), x[None])[0])
    assert want != hf_greedy(llama_ckpt, ids, 12)  # the penalty changes the output
    got = generate_ids(client, ids, 12, repetition_penalty=0.3)
    assert got == want
    # its logprobs are those of the penalised logits
    x = hf_model(str(llama_ckpt))(torch.tensor([ids])).logits[0, -1].float().detach()
    first = torch.log_softmax(proc(torch.tensor([ids]), x[None])[0], -1)
    assert r.choices[0].logprobs.token_logprobs[0] == pytest.approx(float(first[want[0]]), abs=TOL)


def generate_ids(client, ids: list[int], n: int, **extra) -> list[int]:
    """The greedy token ids /generate gives for the same request (the openai client's
    completions show text, not ids)."""
    base = str(client.base_url).removesuffix("/").removesuffix("/v1")
    r = httpx.post(base + "/generate", json={"input_ids": ids, "max_tokens": n, **GREEDY, **NO_EOS, **extra},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["token_ids"]


def test_presence_and_frequency_penalties(client, model, llama_server, llama_ckpt):
    ids = hf_ids(llama_ckpt, PROMPT)

    def openai_penalties(x, out):
        for t in set(out):
            x[t] -= -0.9 * out.count(t) - 1.5
        return x

    want = hf_processed_greedy(llama_ckpt, ids, 12, openai_penalties)
    assert want != hf_greedy(llama_ckpt, ids, 12)
    r = generate(llama_server, input_ids=ids, max_tokens=12, presence_penalty=-1.5, frequency_penalty=-0.9, **GREEDY,
                 **NO_EOS)
    assert r["token_ids"] == want
    c = client.completions.create(model=model, prompt=ids, max_tokens=12, presence_penalty=-1.5,
                                  frequency_penalty=-0.9, extra_body={**GREEDY, **NO_EOS})
    assert c.choices[0].text == r["text"]
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=12,
                                          presence_penalty=-1.5, frequency_penalty=-0.9,
                                          extra_body={**GREEDY, **NO_EOS})
    plain = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=12,
                                           extra_body={**GREEDY, **NO_EOS})
    assert chat.choices[0].message.content != plain.choices[0].message.content


def test_logit_bias_is_transformers_sequence_bias(client, model, llama_ckpt):
    from transformers import SequenceBiasLogitsProcessor

    ids = hf_ids(llama_ckpt, PROMPT)
    plain = hf_greedy(llama_ckpt, ids, 8)
    bias = {plain[0]: -100.0, 42: 4.0, 77: 3.0}
    proc = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})
    want = hf_processed_greedy(llama_ckpt, ids, 8, lambda x, out: proc(torch.tensor([ids + out]), x[None])[0])
    assert want != plain
    r = client.completions.create(model=model, prompt=ids, max_tokens=8,
                                  logit_bias={str(t): b for t, b in bias.items()}, extra_body={**GREEDY, **NO_EOS})
    assert generate_ids(client, ids, 8, logit_bias={str(t): b for t, b in bias.items()}) == want
    assert r.usage.completion_tokens == 8


def test_stop_token_ids_and_min_tokens(client, model, llama_ckpt, llama_server):
    ids = hf_ids(llama_ckpt, PROMPT)
    plain = hf_greedy(llama_ckpt, ids, 16)
    stop = plain[2]
    first = plain.index(stop)
    r = generate(llama_server, input_ids=ids, max_tokens=16, stop_token_ids=[stop], **GREEDY, **NO_EOS)
    assert r["finish_reason"] == "stop" and r["token_ids"] == plain[: first + 1]
    # the stop token counts, its text is not shown (vLLM)
    assert r["usage"]["completion_tokens"] == first + 1
    assert r["text"] == generate(llama_server, input_ids=ids, max_tokens=first, **GREEDY, **NO_EOS)["text"]

    # min_tokens masks it (as transformers' MinNewTokensLengthLogitsProcessor masks EOS)
    from transformers import MinNewTokensLengthLogitsProcessor

    proc = MinNewTokensLengthLogitsProcessor(len(ids), 6, [stop])
    want = hf_processed_greedy(llama_ckpt, ids, 16, lambda x, out: proc(torch.tensor([ids + out]), x[None])[0])
    want = want[: want.index(stop, 6) + 1] if stop in want[6:] else want
    chat = client.completions.create(model=model, prompt=ids, max_tokens=16,
                                     extra_body={**GREEDY, **NO_EOS, "min_tokens": 6, "stop_token_ids": [stop]})
    if want[-1] == stop:  # vLLM's stop_reason: the token that stopped it
        assert chat.choices[0].stop_reason == stop and chat.choices[0].finish_reason == "stop"
    got = generate(llama_server, input_ids=ids, max_tokens=16, min_tokens=6, stop_token_ids=[stop], **GREEDY, **NO_EOS)
    assert got["token_ids"] == want and len(want) > first + 1
    assert chat.usage.completion_tokens == len(want)


def test_min_p_one_keeps_only_the_most_likely(client, model, llama_server, llama_ckpt):
    ids = hf_ids(llama_ckpt, PROMPT)
    r = generate(llama_server, input_ids=ids, max_tokens=10, temperature=1.5, min_p=1.0, seed=7, **NO_EOS)
    assert r["token_ids"] == hf_greedy(llama_ckpt, ids, 10)
    c = client.completions.create(model=model, prompt=ids, max_tokens=10, temperature=1.5, seed=8,
                                  extra_body={"min_p": 1.0, **NO_EOS})
    assert c.choices[0].text == r["text"]


# ---- refusals name the field and the limit -------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty must be a number in [-2, 2], got 2.5"),
        ({"frequency_penalty": "1"}, "frequency_penalty", 'frequency_penalty must be a number in [-2, 2], got "1"'),
        ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty must be a number > 0 (1 = off), got 0"),
        ({"min_p": 1.5}, "min_p", "min_p must be a number in [0, 1], got 1.5"),
        ({"logit_bias": {"5": 101}}, 'logit_bias["5"]', 'logit_bias["5"] must be a number in [-100, 100], got 101'),
        ({"logit_bias": {"x": 1}}, 'logit_bias["x"]',
         'logit_bias["x"] must be keyed by a token id (a non-negative integer), got "x"'),
        ({"logit_bias": {"99999": 1}}, "logit_bias",
         "logit_bias token id 99999 is out of the vocabulary (token ids are below {vocab})"),
        ({"stop_token_ids": [99999]}, "stop_token_ids",
         "stop_token_ids token id 99999 is out of the vocabulary (token ids are below {vocab})"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens", "min_tokens (5) must be at most max_tokens (2)"),
        ({"logprobs": 21}, "logprobs", "logprobs must be an integer in [0, 20], got 21"),
    ],
)
def test_refusals_name_field_and_limit(llama_server, llama_ckpt, body, param, message):
    from tokenizers import Tokenizer

    message = message.format(vocab=Tokenizer.from_file(str(llama_ckpt / "tokenizer.json")).get_vocab_size())
    r = httpx.post(llama_server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["message"]) == (param, message) and "code" in err
    if param != "logprobs":
        g = httpx.post(llama_server.url + "/generate", json={"prompt": "Hello", "max_tokens": 2, **body}, timeout=30)
        assert g.status_code == 400 and g.json()["error"]["param"] == param


def test_chat_top_logprobs_needs_logprobs(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    assert info.value.param == "top_logprobs"


# ---- n > 1 and lists of prompts ------------------------------------------------------------


def test_n3_gives_three_seeded_choices_that_share_the_prompt_pages(client, model, llama_server, llama_ckpt):
    prompt = "Seventeen quiet lanterns drift over the harbour while gulls argue about bread crumbs"
    p = len(hf_ids(llama_ckpt, prompt))
    shareable = (p - 1) // 4 * 4  # full pages before the last prompt row (page size 4)
    hits0 = llama_server.metric("mstar_prefix_cache_hit_tokens_total")
    body = dict(model=model, prompt=prompt, max_tokens=8, temperature=1.0, seed=11, extra_body=NO_EOS)
    r = client.completions.create(**body, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    # the later samples held the first one's prompt pages instead of computing them
    want = hits0 + 2 * shareable
    assert shareable > 0 and llama_server.wait_metric("mstar_prefix_cache_hit_tokens_total", want) == want
    assert r.usage.prompt_tokens == p and r.usage.completion_tokens == 24  # the prompt counted once
    # sample j is the request with seed + j
    singles = [client.completions.create(**{**body, "seed": 11 + j}).choices[0].text for j in range(3)]
    assert [c.text for c in r.choices] == singles and len(set(singles)) > 1
    stream = list(client.completions.create(**body, n=3, stream=True, stream_options={"include_usage": True}))
    texts = ["", "", ""]
    for chunk in stream[:-1]:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == singles and stream[-1].usage == r.usage and stream[-1].choices == []


def test_prompt_list_with_n(client, model, llama_ckpt):
    prompts = ["The quick brown fox", hf_ids(llama_ckpt, "Hello world!")]
    r = client.completions.create(model=model, prompt=prompts, n=2, max_tokens=5, echo=True,
                                  extra_body={**GREEDY, **NO_EOS})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    one = [client.completions.create(model=model, prompt=p, max_tokens=5, echo=True,
                                     extra_body={**GREEDY, **NO_EOS}) for p in prompts]
    assert [c.text for c in r.choices] == [one[0].choices[0].text] * 2 + [one[1].choices[0].text] * 2
    assert r.usage.prompt_tokens == one[0].usage.prompt_tokens + one[1].usage.prompt_tokens
    assert r.usage.completion_tokens == 20


def test_chat_n2(client, model):
    msgs = [{"role": "user", "content": "Say hello"}]
    r = client.chat.completions.create(model=model, messages=msgs, n=2, max_tokens=4, logprobs=True,
                                       extra_body={**GREEDY, **NO_EOS})
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].message.content == r.choices[1].message.content
    assert all(len(c.logprobs.content) == 4 for c in r.choices) and r.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(model=model, messages=msgs, n=2, max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={**GREEDY, **NO_EOS}))
    texts = ["", ""]
    for chunk in chunks[:-1]:
        texts[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
    assert texts == [c.message.content for c in r.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage == r.usage
    assert sorted(c.choices[0].index for c in chunks[:-1] if c.choices[0].finish_reason) == [0, 1]


# ---- metrics -------------------------------------------------------------------------------


def test_metrics_token_counters_equal_usage(client, model, llama_server):
    prompt0 = llama_server.metric("mstar_prompt_tokens_total")
    gen0 = llama_server.metric("mstar_generation_tokens_total")
    usages = [client.completions.create(model=model, prompt=PROMPT, max_tokens=5, logprobs=2,
                                        extra_body=NO_EOS).usage,
              client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                             extra_body=NO_EOS).usage,
              client.completions.create(model=model, prompt=PROMPT, max_tokens=3, echo=True, logprobs=1,
                                        extra_body=NO_EOS).usage,
              client.completions.create(model=model, prompt=[PROMPT, "Other"], n=2, max_tokens=3,
                                        extra_body=NO_EOS).usage]
    want_prompt = sum(u.prompt_tokens for u in usages)
    want_gen = sum(u.completion_tokens for u in usages)
    assert llama_server.wait_metric("mstar_prompt_tokens_total", prompt0 + want_prompt) == prompt0 + want_prompt
    assert llama_server.wait_metric("mstar_generation_tokens_total", gen0 + want_gen) == gen0 + want_gen
