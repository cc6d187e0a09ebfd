"""The thinker's hidden states the talker reads (`HiddenTap` on modeling/vision/qwen3_omni.py's
LM): on a prompt with an image and an audio clip, the rows kept after layer
`accept_hidden_layer` (and the input embeddings, layer 0) equal transformers'
`hidden_states[layer]` there: before deepstack adds to the image rows."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from services.gpu_worker.attention import build_metadata
from services.gpu_worker.kv_memory import kv_cache
from services.gpu_worker.modeling.vision.qwen3_omni import HiddenTap
from shared.specs.vision_lm import mrope_positions
from tests.omni_checkpoints import make_omni_checkpoint, omni_processor, tone, wav_bytes


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_omni_checkpoint(tmp_path_factory.mktemp("omni") / "omni")


def _inputs(ckpt):
    import soundfile as sf
    from PIL import Image

    proc = omni_processor(ckpt)
    parts = [{"type": "image"}, {"type": "audio"}, {"type": "text", "text": "Describe both."}]
    text = proc.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False)
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (64, 96, 3), dtype=np.uint8))
    clip = sf.read(io.BytesIO(wav_bytes(tone(1.3, seed=1))), dtype="float32")[0]
    return proc(text=text, images=[image], audio=[clip], return_tensors="pt")


def _ours(ckpt, inputs, layer: int) -> torch.Tensor:
    from services.gpu_worker.weights import build_model
    from shared.model_source import ModelSource

    src = ModelSource(str(ckpt))
    spec = src.spec(16)
    model = build_model(src, spec, torch.float32)
    ids = inputs["input_ids"][0]
    grid = inputs["image_grid_thw"]
    n = int(inputs["feature_attention_mask"][0].sum())
    with torch.inference_mode():
        image_rows = model.encode_images(inputs["pixel_values"], grid)
        audio_rows = model.encode_audio(inputs["input_features"][0, :, :n], torch.tensor([n]))
    image_at = torch.nonzero(ids == spec.image_token_id).flatten()
    audio_at = torch.nonzero(ids == spec.audio_token_id).flatten()
    audio_rows = torch.nn.functional.pad(audio_rows, (0, image_rows.shape[1] - audio_rows.shape[1]))
    rows = torch.cat([image_at, audio_at])
    order = torch.argsort(rows)
    embeds = (rows[order], torch.cat([image_rows, audio_rows])[order])
    positions, _ = mrope_positions(ids.tolist(), spec.image_token_id, [tuple(g) for g in grid.tolist()],
                                   spec.merge_size)
    pool = next(iter(spec.paged_pools(32).values()))
    caches = kv_cache(pool.num_layers, pool.num_pages, 16, pool.kv_heads, pool.head_dim, torch.float32,
                      torch.device("cpu"))
    meta = build_metadata([(list(range(32)), 0, 0, len(ids), False)], 16)
    lm = model.lm
    lm.tap = HiddenTap(layer, rows)
    with torch.inference_mode():
        lm.hidden(ids, torch.from_numpy(positions), caches, [meta] * len(caches), embeds)
    out, lm.tap = lm.tap.out, None
    assert out is not None
    return out


@pytest.fixture(scope="module")
def reference(ckpt):
    """(the processor's inputs, transformers' thinker with its hidden states of every layer)."""
    import transformers

    inputs = _inputs(ckpt)
    hf = transformers.Qwen3OmniMoeForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        states = hf.thinker(**inputs, output_hidden_states=True).hidden_states
    return inputs, hf, states


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_tapped_rows_equal_transformers_hidden_states(ckpt, reference, layer):
    inputs, hf, states = reference
    ref = states[layer][0]
    ours = _ours(ckpt, inputs, layer)
    ids = inputs["input_ids"][0]
    mm = torch.nonzero((ids == hf.config.thinker_config.image_token_id)
                       | (ids == hf.config.thinker_config.audio_token_id)).flatten()
    assert len(mm) > 10
    np.testing.assert_allclose(ours.numpy(), ref[mm].numpy(), atol=1e-4)
