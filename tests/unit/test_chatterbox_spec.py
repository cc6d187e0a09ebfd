"""Chatterbox's spec without weights: the Hub folder recognised without config.json, the
package's text clean-up, the extensions' checks, and a request's rows on both labels."""

from __future__ import annotations

import json

import pytest

from services.gpu_worker.codecs.s3gen import valid_tokens
from shared.specs.base import PromptError, PromptRequest
from shared.specs.chatterbox import ChatterboxSpec, folder_config, is_chatterbox_folder, punc_norm

TINY = {"t3": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 16, "intermediate_size": 128, "perceiver": {"pre_attention_query_token": 8}}}


@pytest.fixture
def spec() -> ChatterboxSpec:
    return ChatterboxSpec(TINY, page_size=16)


def test_folder_without_config_is_chatterbox(tmp_path):
    for name in ("t3_cfg.safetensors", "conds.pt"):
        (tmp_path / name).write_bytes(b"")
    assert is_chatterbox_folder(tmp_path)
    assert folder_config(tmp_path) == {"architectures": ["ChatterboxTTS"]}
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    assert folder_config(tmp_path)["t3"]["hidden_size"] == 64


@pytest.mark.parametrize(("text", "want"), [
    ("hello world", "Hello world."),
    ("  wait...  what:  now ", "wait,  what, now."),  # capitalised before the spaces go; "..." makes two
    ("", "You need to add some text for me to talk."),
    ("“Quoted” — yes!", "\"Quoted\" - yes!"),
])
def test_punc_norm_is_the_packages(text, want):
    assert punc_norm(text) == want


def test_prompt_text_spells_spaces(spec):
    assert spec.prompt_text("hi there", {}) == "Hi[SPACE]there."


@pytest.mark.parametrize(("options", "param"), [
    ({"exaggeration": 2.5}, "exaggeration"), ({"cfg_weight": -0.1}, "cfg_weight"),
    ({"cfg_weight": "high"}, "cfg_weight"), ({"voice": "alloy"}, "voice"),
])
def test_bad_extensions_name_the_field(spec, options, param):
    with pytest.raises(PromptError) as err:
        spec.process_prompt(PromptRequest([20, 21], options=options))
    assert err.value.param == param


def test_rows_on_both_labels(spec):
    out = spec.process_prompt(PromptRequest([20, 21, 22], options={"exaggeration": 1.0}))
    rows = spec.cond_rows + 5 + 2  # the prefix, [START] text [STOP], the start of speech twice
    assert spec.cond_rows == 10 and list(out.kv_layout) == ["cond", "uncond"]
    for layout in out.kv_layout.values():
        assert sum(s.length for s in layout.spans) == rows and layout.growth == {"frame_loop": 1}
    assert out.new_input_tensors["input_ids"][spec.cond_rows:].tolist() == [255, 20, 21, 22, 0, 6561, 6561]
    assert out.new_input_tensors["guidance"].tolist() == [1.0, 0.5]


def test_s3gen_takes_the_packages_tokens():
    assert valid_tokens([5, 6561, 7, 8, 6600, 9, 6562, 10]) == [7, 8, 9]
    assert valid_tokens([1, 2, 3]) == [1, 2, 3]


def test_a_reference_clip_is_one_audio_turn(spec):
    """A clip: decoded at 24 kHz and sent as `context_audio` (the voice "clip"); two turns,
    a transcript, no audio, or bytes that are not audio are refused naming the field."""
    import base64
    import io

    import numpy as np
    import soundfile as sf

    from shared.frames import ContextTurn

    buf = io.BytesIO()
    sf.write(buf, np.zeros(8000, dtype=np.float32), 16000, format="WAV")
    audio = buf.getvalue()
    (clip,), text = spec.prepare_context([ContextTurn("0", "", audio)])
    assert text == "" and len(clip.samples) == 12000 and clip.param == "context[0].audio"
    out = spec.process_prompt(PromptRequest([5, 6], context=(clip,)))
    assert out.metadata["voice"] == "clip" and out.new_input_tensors["context_audio"].shape == (12000,)
    short = io.BytesIO()
    sf.write(short, np.zeros(1600, dtype=np.float32), 16000, format="WAV")
    for turns, param in (([ContextTurn("0", "", audio)] * 2, "context"),
                         ([ContextTurn("0", "hi", audio)], "context[0].text"),
                         ([ContextTurn("0", "")], "context[0].audio"),
                         ([ContextTurn("0", "", short.getvalue())], "context[0].audio"),
                         ([ContextTurn("0", "", base64.b64encode(b"not audio"))], "context[0].audio")):
        with pytest.raises(PromptError) as err:
            spec.prepare_context(turns)
        assert err.value.param == param
