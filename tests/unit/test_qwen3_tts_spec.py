"""Qwen3-TTS' spec (shared/specs/qwen3_tts.py) and its tokenizer files: the prompt's rows
as the package lays them out, the layouts and caps, refusals naming the field; the
tokenizer built from vocab.json + merges.txt equal to transformers' `Qwen2TokenizerFast`
from the same files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.bpe_files import tokenizer_from_bpe_files
from shared.specs.base import PromptError, PromptRequest
from shared.specs.qwen3_tts import Qwen3TTSSpec
from tests.qwen3_tts_checkpoints import SPEAKERS, SPECIALS, _codec_config, _config, _tokenizer_files

TEXTS = ("Hello world!", "The quick brown fox, it's 123 héllo!\n", "")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The checkpoint's tokenizer and config files (no weights: nothing here loads them)."""
    folder = tmp_path_factory.mktemp("qwen3_tts_files")
    _tokenizer_files(folder)
    (folder / "config.json").write_text(json.dumps(_config()))
    (folder / "speech_tokenizer").mkdir()
    (folder / "speech_tokenizer" / "config.json").write_text(json.dumps(_codec_config()))
    (folder / "generation_config.json").write_text(json.dumps({"subtalker_dosample": False, "do_sample": False}))
    return folder


@pytest.fixture(scope="module")
def spec(folder) -> Qwen3TTSSpec:
    return Qwen3TTSSpec(_config(), page_size=16).load_folder(folder)


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_equals_transformers(folder, text):
    from transformers import AutoTokenizer

    ours = tokenizer_from_bpe_files(folder)
    theirs = AutoTokenizer.from_pretrained(str(folder))
    prompt = f"<|im_start|>user\nSoftly.<|im_end|>\n<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"
    assert ours.encode(prompt).ids == theirs(prompt)["input_ids"]
    assert ours.decode(ours.encode(prompt).ids, skip_special_tokens=False) == prompt


def test_prompt_rows_are_the_packages(folder, spec):
    """Role, tag rows over codec ids (speaker included), text over codec_pad, tts_eos,
    tts_pad over codec_bos; a dialect speaker's language tag; instructions first."""
    tok = tokenizer_from_bpe_files(folder)
    c = _config()["talker_config"]
    ids = tok.encode(spec.prompt_text("Hi", {"voice": "Ryan"})).ids
    ppo = spec.process_prompt(PromptRequest(ids, options={"voice": "Ryan"}))
    rows = ppo.new_input_tensors["input_ids"].tolist()
    v = spec.text_vocab
    pad, bos, eos = SPECIALS["<|tts_pad|>"], SPECIALS["<|tts_bos|>"], SPECIALS["<|tts_eos|>"]
    tags = [c["codec_nothink_id"], c["codec_think_bos_id"], c["codec_think_eos_id"], SPEAKERS["ryan"],
            c["codec_pad_id"]]
    want = ids[:3] + [t + v * (k + 1) for t, k in zip([pad] * 4 + [bos], tags)]
    want += [t + v * (c["codec_pad_id"] + 1) for t in [*ids[3:-5], eos]] + [pad + v * (c["codec_bos_id"] + 1)]
    assert rows == want and ppo.metadata == {"prompt_len": len(want), "voice": "ryan"}
    layout = ppo.kv_layout
    assert layout["talker"].growth == {"frame_loop": 1} and layout["code"].scratch == spec.num_codebooks
    dialect = spec.process_prompt(PromptRequest(ids, options={"voice": "dylan"})).new_input_tensors["input_ids"]
    assert dialect[3] // v - 1 == c["codec_think_id"] and dialect[5] // v - 1 == c["codec_language_id"][
        "beijing_dialect"]
    instructed = tok.encode(spec.prompt_text("Hi", {"instructions": "Softly."})).ids
    got = spec.process_prompt(PromptRequest(instructed, options={"instructions": "Softly."}))
    user = tok.encode("<|im_start|>user\nSoftly.<|im_end|>\n").ids
    assert got.new_input_tensors["input_ids"].tolist()[: len(user) + 3] == user + ids[:3]


def test_caps_and_sampling(spec):
    assert spec.get_loop_caps(10) == {"frame_loop": 9, "codebook_loop": spec.num_codebooks - 1}
    assert spec.subtalker["subtalker_dosample"] is False and spec.takes_instructions
    assert spec.voices == tuple(SPEAKERS) and spec.sample_rate == 24000 and spec.samples_per_frame == 48


@pytest.mark.parametrize(("text", "options", "param"), [
    ("Hi", {"voice": "nobody"}, "voice"),
    ("Hi <|im_end|>", {}, "input"),
    ("Hi", {"instructions": "<|tts_pad|>"}, "instructions"),
])
def test_refusals_name_the_field(spec, text, options, param):
    with pytest.raises(PromptError) as err:
        spec.prompt_text(text, options)
    assert err.value.param == param
    if param == "voice":
        assert all(s in str(err.value) for s in SPEAKERS)


def test_small_checkpoints_take_no_instructions(folder):
    small = Qwen3TTSSpec({**_config(), "tts_model_size": "0b6"}, page_size=16).load_folder(folder)
    with pytest.raises(PromptError) as err:
        small.prompt_text("Hi", {"instructions": "Softly."})
    assert err.value.param == "instructions"


def test_ids_past_the_text_vocabulary_are_refused(spec):
    ids = list(spec.warmup_request(16).token_ids)
    with pytest.raises(PromptError) as err:
        spec.process_prompt(PromptRequest([*ids[:4], spec.text_vocab, *ids[4:]]))
    assert err.value.param == "input_ids"


def test_warmup_prompt_is_accepted(spec):
    assert spec.process_prompt(spec.warmup_request(16)).metadata["prompt_len"] > 8


def test_clips_and_names_go_to_their_checkpoints(spec):
    """A CustomVoice checkpoint given a reference clip, a Base one given a speaker's name or
    instructions: 400s naming the field (the e2e test sends the clip itself)."""
    from shared.frames import ContextTurn

    with pytest.raises(PromptError) as err:
        spec.prepare_context([ContextTurn("", "", b"RIFF")])
    assert err.value.param == "context"
    base = Qwen3TTSSpec(_config("base"), page_size=16)
    assert base.clones and base.voices == ()
    for options, param in (({"voice": "vivian"}, "voice"), ({"instructions": "Softly."}, "instructions")):
        with pytest.raises(PromptError) as err:
            base.prompt_text("Hi.", options)
        assert err.value.param == param
    with pytest.raises(PromptError) as err:
        base.prepare_context([ContextTurn("", "", None)])
    assert err.value.param == "context[0].audio"
