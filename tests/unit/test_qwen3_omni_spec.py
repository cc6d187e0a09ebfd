"""Qwen3-Omni's spec without a checkpoint's weights: the release's config shape read as a
Qwen3-MoE text model, the audio row count equal to transformers' formula, audio runs cut
into keyed rows spans, and refusals that name the field."""

from __future__ import annotations

import numpy as np
import pytest

from shared.layout import Span
from shared.specs.base import PreparedClip, PromptError, PromptRequest
from shared.specs.qwen3_omni import AUDIO_TOKEN, Qwen3OmniSpec, audio_rows, audio_spans
from tests.omni_checkpoints import tone, wav_bytes

#: the release's thinker text config (Qwen3-Omni-30B-A3B), in its `rope_scaling` form
TEXT = {"decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
        "intermediate_size": 768, "max_position_embeddings": 65536, "mlp_only_layers": [],
        "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
        "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
        "rope_scaling": {"interleaved": True, "mrope_interleaved": True, "mrope_section": [24, 20, 20],
                         "rope_type": "default", "type": "default"},
        "rope_theta": 1000000, "sliding_window": None, "use_sliding_window": False, "vocab_size": 152064}
CONFIG = {"architectures": ["Qwen3OmniMoeForConditionalGeneration"], "model_type": "qwen3_omni_moe",
          "thinker_config": {"text_config": TEXT, "audio_token_id": 151646, "image_token_id": 151655,
                             "audio_config": {"num_mel_bins": 128, "n_window": 50}, "vision_config": {}}}


def test_the_release_config_is_a_qwen3_moe_text_model() -> None:
    spec = Qwen3OmniSpec(CONFIG, page_size=16)
    assert spec.mrope_section == (24, 20, 20) and spec.config.rope.theta == 1e6
    assert (spec.config.num_experts, spec.config.head_dim, spec.max_seq_len) == (128, 128, 65536)
    assert spec.audio_placeholder == AUDIO_TOKEN and spec.engine == "omni_thinker"


#: transformers' `_get_feat_extract_output_lengths(frames, 50)` (5.25), frames -> rows
ROWS = {10: 2, 99: 13, 100: 13, 101: 14, 230: 30, 1000: 130, 3001: 391}


def test_audio_rows_are_transformers() -> None:
    assert {frames: audio_rows(frames) for frames in ROWS} == ROWS


def test_audio_runs_become_keyed_rows_spans() -> None:
    clip = PreparedClip(np.zeros((128, 230), np.float32), AUDIO_TOKEN * 30, "k")
    a = 7
    ids = [1, 2, *[a] * 30, 3]
    spans = audio_spans((Span.ids(ids),), ids, a, (clip,), 50)
    assert spans == (Span.ids([1, 2]), Span.rows(30, "k:0"), Span.ids([3]))
    short = [1, 2, *[a] * 29, 3]
    with pytest.raises(PromptError, match="holds 29 audio tokens"):
        audio_spans((Span.ids(short),), short, a, (clip,), 50)
    split = [1, *[a] * 10, 2, *[a] * 20]
    with pytest.raises(PromptError, match="not one run"):
        audio_spans((Span.ids(split),), split, a, (clip,), 50)


def test_bad_clips_are_refused_naming_them() -> None:
    spec = Qwen3OmniSpec(CONFIG, page_size=16)
    good = wav_bytes(tone(0.5))
    with pytest.raises(PromptError) as exc:
        spec.prepare_audios([good, b"not audio at all" * 10])
    assert exc.value.param == "audios[1]"
    with pytest.raises(PromptError, match=r"at least 0\.1 s") as exc:
        spec.prepare_audios([wav_bytes(tone(0.05))])
    assert exc.value.param == "audios[0]"
    with pytest.raises(PromptError) as exc:
        spec.process_prompt(PromptRequest([1, 2, 151646]))
    assert exc.value.param == "input_ids"


#: a talker as the release's (its stacks' KV shapes; two voices)
TALKER = {"text_config": {"num_hidden_layers": 20, "num_key_value_heads": 2, "head_dim": 128, "hidden_size": 1024,
                          "num_attention_heads": 16},
          "code_predictor_config": {"num_hidden_layers": 5, "num_key_value_heads": 8, "head_dim": 128,
                                    "hidden_size": 1024, "num_attention_heads": 16},
          "num_code_groups": 16, "speaker_id": {"Ethan": 2302, "Chelsie": 2301}}
IM_START, USER, ASSISTANT = 151644, 872, 77091


def test_speech_out_declares_the_talkers_labels_up_front() -> None:
    """With a voice: the thinker's layout as without, the talker's rows (user turns' rows +
    9 opening rows, a row a frame) and the code predictor's scratch (a frame's codes); the
    frame loop's cap is 8 frames a text token, at most 300 s; a voice it lacks is refused."""
    spec = Qwen3OmniSpec({**CONFIG, "talker_config": TALKER}, page_size=16)
    assert spec.voices == ("chelsie", "ethan")
    assert {n: (p.num_layers, p.kv_heads) for n, p in spec.paged_pools(8).items()} == {
        "kv": (48, 4), "talker": (20, 2), "code": (5, 8)}
    assert spec.get_loop_caps(10) == {"decode_loop": 9, "frame_loop": 80}
    assert spec.get_loop_caps(10_000)["frame_loop"] == 3750 == spec.graph_loops()["frame_loop"]
    ids = [IM_START, 9125, 198, 5, IM_START, USER, 198, 7, 8, IM_START, ASSISTANT, 198]
    text = spec.process_prompt(PromptRequest(ids))
    speech = spec.process_prompt(PromptRequest(ids, options={"voice": "Ethan"}))
    assert set(text.kv_layout) == {"text"} and speech.kv_layout["text"] == text.kv_layout["text"]
    assert speech.kv_layout["talker"].spans == (Span.rows(5 + 9),)  # the user turn: 5 tokens
    assert speech.kv_layout["talker"].growth == {"frame_loop": 1}
    assert speech.kv_layout["code"].scratch == 16 and speech.metadata["voice"] == "ethan"
    with pytest.raises(PromptError) as err:
        spec.process_prompt(PromptRequest(ids, options={"voice": "nobody"}))
    assert err.value.param == "audio.voice"
    assert Qwen3OmniSpec(CONFIG, page_size=16).voices == ()  # no talker: text only
