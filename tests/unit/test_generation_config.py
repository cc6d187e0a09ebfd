"""A checkpoint's generation_config.json as the model's default sampling (issue 48): which
keys are read, `do_sample: false` as greedy, values out of range refused naming the file
and key, and `--generation-config` auto / vllm / none / a folder."""

from __future__ import annotations

import json

import pytest

from shared.generation_config import GenerationDefaults, parse_generation_config, read_generation_defaults


def test_the_sampling_keys_and_max_new_tokens_are_read():
    got = parse_generation_config({"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.05,
                                   "repetition_penalty": 1.05, "max_new_tokens": 84, "do_sample": True,
                                   "eos_token_id": [1, 2], "bos_token_id": 1, "transformers_version": "5.0"})
    assert got == GenerationDefaults(0.7, 0.8, 20, 0.05, 1.05, 84)
    assert got.sampling() == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.05,
                              "repetition_penalty": 1.05}
    assert got.describe() == "temperature=0.7, top_p=0.8, top_k=20, min_p=0.05, repetition_penalty=1.05, max_tokens=84"


def test_do_sample_false_is_greedy_as_transformers_reads_it():
    got = parse_generation_config({"do_sample": False, "temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1,
                                   "max_new_tokens": 84})
    assert got == GenerationDefaults(temperature=0.0, repetition_penalty=1.1, max_tokens=84)


def test_a_file_without_sampling_keys_sets_nothing():
    got = parse_generation_config({"_from_model_config": True, "eos_token_id": 2, "pad_token_id": 0})
    assert got == GenerationDefaults() and got.sampling() == {} and got.describe() == "none"
    assert parse_generation_config({"top_k": -1}).top_k == 0  # off, the frame's one value for it


@pytest.mark.parametrize("data, words", [
    ({"temperature": -1}, "temperature must be >= 0, got -1"),
    ({"top_p": 0}, "top_p must be in (0, 1], got 0"),
    ({"top_k": 2.5}, "top_k must be an integer, got 2.5"),
    ({"max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0"),
    ({"temperature": "hot"}, "temperature must be a number, got 'hot'"),
    ({"repetition_penalty": True}, "repetition_penalty must be a number, got True"),
])
def test_a_value_out_of_range_is_refused_naming_the_file_and_key(data, words):
    with pytest.raises(ValueError) as info:
        parse_generation_config(data, "ckpt/generation_config.json")
    assert str(info.value) == f"ckpt/generation_config.json: {words}"


def test_the_flag_auto_vllm_none_and_a_folder(tmp_path):
    ckpt, other = tmp_path / "ckpt", tmp_path / "other"
    ckpt.mkdir()
    other.mkdir()
    (ckpt / "generation_config.json").write_text(json.dumps({"temperature": 0.5}))
    (other / "generation_config.json").write_text(json.dumps({"top_k": 5}))
    assert read_generation_defaults("auto", ckpt) == GenerationDefaults(temperature=0.5)
    assert read_generation_defaults("vllm", ckpt) == read_generation_defaults("none", ckpt) == GenerationDefaults()
    assert read_generation_defaults(str(other), ckpt) == GenerationDefaults(top_k=5)
    assert read_generation_defaults(str(other / "generation_config.json"), None) == GenerationDefaults(top_k=5)
    assert read_generation_defaults("auto", None) == GenerationDefaults()  # a GGUF file has none
    assert read_generation_defaults("auto", other.parent / "missing") == GenerationDefaults()
    with pytest.raises(ValueError, match=r"no generation_config\.json there"):
        read_generation_defaults(str(tmp_path / "nowhere"), ckpt)
    (other / "generation_config.json").write_text("[1]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        read_generation_defaults(str(other), ckpt)
