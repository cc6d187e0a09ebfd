"""WhisperSpec: the registry entry, its two labels and pools, the forced decoder prompt,
`process_prompt` (audio, options, layouts, metadata, the language probe's scratch), loop
caps and footprints (no weights needed)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from shared.audio import audio_features
from shared.layout import LabelLayout, Span, label_footprint
from shared.model_source import ModelSource
from shared.specs.base import PromptError, PromptRequest
from shared.specs.whisper import WhisperSpec
from tests.whisper_checkpoints import LANGUAGES, sine_sweep, wav_bytes, whisper_ckpt  # noqa: F401  (fixture)

PAGE = 16


@pytest.fixture(scope="module")
def spec(whisper_ckpt):  # noqa: F811
    return WhisperSpec.from_folder(whisper_ckpt, page_size=PAGE)


def tok_ids(path) -> dict[str, int]:
    tok = json.loads((path / "tokenizer.json").read_text())
    return {t["content"]: t["id"] for t in tok["added_tokens"]}


def test_registry_builds_a_whisper_spec(whisper_ckpt):  # noqa: F811
    source = ModelSource(str(whisper_ckpt))
    spec = source.spec(PAGE)
    assert isinstance(spec, WhisperSpec)
    assert spec.engine == "encoder_decoder" and spec.takes_audio
    spec.validate()
    assert source.tokenizer.eos_token_ids == [tok_ids(whisper_ckpt)["<|endoftext|>"]]
    # config.json alone knows the start token; the folder adds the language and task tables
    assert spec.forced_ids()[0] == tok_ids(whisper_ckpt)["<|startoftranscript|>"]
    assert (spec.load_folder(whisper_ckpt).forced_ids()
            == WhisperSpec.from_folder(whisper_ckpt, page_size=PAGE).forced_ids())


def test_labels_and_pools(spec):
    self_lab, cross_lab = spec.kv_labels
    assert (self_lab.name, self_lab.pool, self_lab.keys, self_lab.grows_on, self_lab.window) == (
        "self", "kv_self", False, "decode_loop", None)
    assert (cross_lab.name, cross_lab.pool, cross_lab.keys, cross_lab.grows_on) == ("cross", "kv_cross", False, None)
    pools = spec.paged_pools(40)
    s, c = pools["kv_self"], pools["kv_cross"]
    for p in (s, c):
        assert (p.num_layers, p.kv_heads, p.head_dim, p.page_size, p.dtype) == (2, 4, 16, PAGE, "float32")
    assert (s.num_pages, s.max_seq_len, c.max_seq_len) == (40, 64, 1500)
    # as many full-length requests fit in each pool: 40 / 4 self pages, 10 x 94 cross pages
    assert c.num_pages == 40 * math.ceil(1500 / PAGE) // math.ceil(64 / PAGE) == 940
    row = 2 * 2 * 4 * 16 * 4  # layers x (K, V) x heads x head_dim x float32
    assert spec.bytes_per_page(PAGE) == math.ceil(PAGE * row * (1 + 94 / 4))
    assert spec.graph_loops() == {"decode_loop": 63}


def test_forced_decoder_prompt(spec, whisper_ckpt):  # noqa: F811
    ids = tok_ids(whisper_ckpt)
    sot, nts = ids["<|startoftranscript|>"], ids["<|notimestamps|>"]
    assert spec.forced_ids() == [sot, ids["<|en|>"], ids["<|transcribe|>"], nts]
    assert spec.forced_ids("de") == [sot, ids["<|de|>"], ids["<|transcribe|>"], nts]
    assert spec.forced_ids("<|fr|>", "translate") == [sot, ids["<|fr|>"], ids["<|translate|>"], nts]
    with pytest.raises(ValueError, match="language 'xx' is not supported; supported: de, en, es"):
        spec.forced_ids("xx")
    with pytest.raises(ValueError, match="task 'summarize' is not supported"):
        spec.forced_ids("en", "summarize")


def test_language_tokens_from_the_tokenizer_when_the_generation_config_has_none(whisper_ckpt, tmp_path):  # noqa: F811
    import shutil

    folder = tmp_path / "w"
    shutil.copytree(whisper_ckpt, folder)
    gen = json.loads((folder / "generation_config.json").read_text())
    for key in ("lang_to_id", "task_to_id", "no_timestamps_token_id", "forced_decoder_ids"):
        gen.pop(key)
    (folder / "generation_config.json").write_text(json.dumps(gen))
    spec = WhisperSpec.from_folder(folder, page_size=PAGE)
    assert spec.forced_ids("ko") == WhisperSpec.from_folder(whisper_ckpt, page_size=PAGE).forced_ids("ko")


def test_english_only_model(spec):
    en = WhisperSpec(spec.config, page_size=PAGE)  # config.json alone: no language table
    en.forced_decoder_ids, en.lang_to_id, en.no_timestamps_token_id = [(1, 99)], {}, 98
    assert en.forced_ids() == [spec.decoder_start_token_id, 99, 98]
    with pytest.raises(ValueError, match="English-only"):
        en.forced_ids("de")


def test_process_prompt_layouts_and_tensors(spec, whisper_ckpt):  # noqa: F811
    """A request's audio and options go through process_prompt: features from the file,
    the forced prompt from the language and task, both labels' layouts, metadata."""
    audio = wav_bytes(sine_sweep(2.0), 16000)
    ppo = spec.process_prompt(PromptRequest([], audio, {"language": "de"}))
    forced = spec.forced_ids("de")
    assert set(ppo.new_input_tensors) == {"input_features", "decoder_input_ids"}
    feats = ppo.new_input_tensors["input_features"]
    assert feats.shape == (1, 80, 3000) and feats.dtype == np.float32
    assert np.array_equal(feats, audio_features(audio, spec.features))
    assert ppo.new_input_tensors["decoder_input_ids"].dtype == np.int32
    assert ppo.new_input_tensors["decoder_input_ids"].tolist() == forced
    assert ppo.kv_layout["self"].spans == (Span.rows(len(forced)),)  # its KV depends on the audio
    assert ppo.kv_layout["self"].growth == {"decode_loop": 1} and ppo.kv_layout["self"].scratch == 0
    assert ppo.kv_layout["cross"].spans == (Span.rows(1500),)
    assert ppo.kv_layout["cross"].growth == {} and ppo.kv_layout["cross"].scratch == 0
    assert ppo.metadata == {"prompt_len": 4, "language": "de", "task": "transcribe", "detect_language": False}
    assert set(ppo.metadata) <= spec.metadata_keys
    spec.refuse_undeclared_labels(ppo.kv_layout)
    # the warm-up sends a decoder prompt and no audio: silence
    silent = spec.process_prompt(PromptRequest([1, 2, 3])).new_input_tensors
    assert np.allclose(silent["input_features"], -1.5) and silent["decoder_input_ids"].tolist() == [1, 2, 3]


def test_no_language_detects_it_with_one_scratch_row(spec, whisper_ckpt):  # noqa: F811
    """This checkpoint's forced_decoder_ids leave the language open (as the real
    multilingual ones do): a request without one detects it. Its prompt leaves the
    language slot out, its "self" label declares the probe's row as scratch, and the span
    still counts the four rows the real prompt will write."""
    ids = tok_ids(whisper_ckpt)
    audio = wav_bytes(sine_sweep(1.0), 16000)
    assert spec.detects_language(None) and not spec.detects_language("en")
    ppo = spec.process_prompt(PromptRequest([], audio, {"task": "translate"}))
    assert ppo.new_input_tensors["decoder_input_ids"].tolist() == [
        ids["<|startoftranscript|>"], ids["<|translate|>"], ids["<|notimestamps|>"]]
    assert ppo.kv_layout["self"] == LabelLayout(spans=(Span.rows(4),), scratch=1, growth={"decode_loop": 1})
    assert ppo.metadata == {"prompt_len": 4, "language": None, "task": "translate", "detect_language": True}
    caps = spec.clamp_caps(spec.get_loop_caps(13))
    assert spec.kv_configs(ppo.kv_layout, caps, spec.paged_pools(10))["kv_self"].footprints == {
        "self": math.ceil((4 + 1 + 12) / PAGE)}
    assert spec.language_ids() == sorted(ids[f"<|{lang}|>"] for lang in LANGUAGES)
    assert spec.language_code(ids["<|ko|>"]) == "ko" and spec.language_code(ids["<|translate|>"]) is None
    # a configured default language, or one in forced_decoder_ids, is used instead
    fixed = WhisperSpec.from_folder(whisper_ckpt, page_size=PAGE)
    fixed.forced_decoder_ids = [(1, ids["<|fr|>"]), (2, ids["<|transcribe|>"])]
    assert not fixed.detects_language(None) and fixed.decoder_prompt()[0][1] == ids["<|fr|>"]
    fixed = WhisperSpec.from_folder(whisper_ckpt, page_size=PAGE)
    fixed.generation["language"] = "es"
    assert not fixed.detects_language(None) and fixed.decoder_prompt() == (fixed.forced_ids("es"), False)


@pytest.mark.parametrize(
    ("request_", "param", "message"),
    [
        (PromptRequest([], b"RIFF....WAVEfmt ", {}), "file", "could not be decoded"),
        (PromptRequest([], None, {"language": "xx"}), "language", "'xx' is not supported"),
        (PromptRequest([], None, {"language": 3}), "language", "language must be a string"),
        (PromptRequest([], None, {"task": "summarize"}), "task", "'summarize' is not supported"),
        (PromptRequest([10_000]), "input_ids", r"must be in \[0, 336\)"),
        (PromptRequest(list(range(64))), "input_ids", "max_seq_len is 64"),
    ],
)
def test_process_prompt_refuses_bad_requests(spec, request_, param, message):
    with pytest.raises(PromptError, match=message) as err:
        spec.process_prompt(request_)
    assert err.value.param == param


def test_loop_caps_and_footprints(spec):
    window = 64 - 4
    assert spec.get_loop_caps(1) == {"decode_loop": 1}
    assert spec.get_loop_caps(10) == {"decode_loop": 9}
    assert spec.get_loop_caps(window) == {"decode_loop": window - 1}
    assert spec.get_loop_caps(1000) == {"decode_loop": window - 1}
    assert spec.get_loop_caps(1000, prompt_len=2) == {"decode_loop": 61}
    ppo = spec.process_prompt(PromptRequest(spec.forced_ids()))
    caps = spec.clamp_caps(spec.get_loop_caps(20))
    configs = spec.kv_configs(ppo.kv_layout, caps, spec.paged_pools(100))
    assert configs["kv_self"].footprints == {"self": math.ceil((4 + 19) / PAGE)}
    assert configs["kv_cross"].footprints == {"cross": math.ceil(1500 / PAGE)}
    # running to the decoder's window fills exactly max_target_positions - 1 rows
    full = spec.clamp_caps(spec.get_loop_caps(window))
    assert label_footprint(ppo.kv_layout["self"], full, PAGE) == math.ceil(63 / PAGE)
