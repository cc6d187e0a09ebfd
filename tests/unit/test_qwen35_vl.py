"""Qwen3.5 with images against transformers, on a tiny random checkpoint made here (the
release's preprocessor_config.json beside it): the image half of its processor (pixel
values bit for bit, grids, prompt expansion and ids), the positions of `get_rope_index`, the
vision tower's rows and the interleaved M-RoPE tables bit for bit; that the images change
transformers' answer (so the e2e parity is about them); the runner's method resolution;
and a folder without image settings served as text."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from shared.model_source import ModelSource
from shared.specs.base import PromptError, PromptRequest
from shared.specs.hybrid_vision_lm import Qwen35VLSpec
from tests.hybrid_vlm_checkpoints import make_qwen35_vl_checkpoint, qwen35_vl_processor


def _noise(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


#: up- and downscaled by the release's pixel bounds, none square
IMAGES = [_noise(24, 20, 1), _noise(70, 30, 2), _noise(300, 500, 3)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen35_vl_checkpoint(tmp_path_factory.mktemp("qwen35vl") / "ckpt")


@pytest.fixture(scope="module")
def processor(folder: Path) -> Any:
    return qwen35_vl_processor(folder)


@pytest.fixture(scope="module")
def hf_model(folder: Path) -> Any:
    import transformers

    return transformers.Qwen3_5ForConditionalGeneration.from_pretrained(folder).eval()


@pytest.fixture(scope="module")
def spec(folder: Path) -> Qwen35VLSpec:
    spec = ModelSource(str(folder)).spec(page_size=8)
    assert isinstance(spec, Qwen35VLSpec)
    return spec


@pytest.fixture(scope="module")
def model(folder: Path) -> Any:
    from safetensors.torch import load_file

    from services.gpu_worker.modeling.hybrid.qwen3_5_vision import Qwen35VLModel

    with torch.device("meta"):
        m = Qwen35VLModel(json.loads((folder / "config.json").read_text()))
    m.load_weights(load_file(folder / "model.safetensors"))
    m.reset_buffers()
    return m.eval()


def _inputs(processor: Any, images: list[Image.Image]) -> tuple[str, Any]:
    """(the chat turn as rendered, transformers' processor outputs for it)."""
    parts: list[dict] = [{"type": "image"} for _ in images] + [{"type": "text", "text": "What is this?"}]
    prompt = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)
    return prompt, processor(text=[prompt], images=[images], return_tensors="pt")


def _expand(spec: Qwen35VLSpec, prompt: str, prepared: list) -> str:
    """The data worker's expansion: each placeholder replaced by its image's text, in order."""
    pieces = prompt.split(spec.image_placeholder)
    assert len(pieces) == len(prepared) + 1
    return "".join(p + (prepared[i].text if i < len(prepared) else "") for i, p in enumerate(pieces))


def test_images_ids_and_positions_equal_transformers(spec: Qwen35VLSpec, processor: Any, hf_model: Any) -> None:
    assert spec.image_placeholder == "<|image_pad|>"
    images = spec._settings()
    assert (images.patch_size, images.merge_size, images.min_pixels, images.image_mean) == (16, 2, 65536,
                                                                                            (0.5, 0.5, 0.5))
    prepared = [spec.prepare_image(_png(im)) for im in IMAGES]
    prompt, inputs = _inputs(processor, IMAGES)
    ids = processor.tokenizer(_expand(spec, prompt, prepared))["input_ids"]
    assert ids == inputs["input_ids"][0].tolist()
    out = spec.process_prompt(PromptRequest(token_ids=ids, images=tuple(prepared)))
    tensors = out.new_input_tensors
    assert np.array_equal(tensors["pixel_values"], inputs["pixel_values"].numpy())
    assert np.array_equal(tensors["image_grid_thw"], inputs["image_grid_thw"].numpy())
    want, delta = hf_model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                inputs["image_grid_thw"])
    assert np.array_equal(tensors["mrope_positions"], want[:, 0].numpy())
    assert out.metadata["mrope_delta"] == int(delta) != 0
    # the text label's image rows are keyed by content; the state label is one unkeyed rows span
    assert {s.key for s in out.kv_layout["text"].spans if s.key} and len(out.kv_layout["state"].spans) == 1


def test_tower_rows_and_rope_tables_equal_transformers(model: Any, processor: Any, hf_model: Any) -> None:
    _, inputs = _inputs(processor, IMAGES)
    with torch.inference_mode():
        rows = model.encode_images(inputs["pixel_values"], inputs["image_grid_thw"])
        want = torch.cat(hf_model.model.get_image_features(inputs["pixel_values"],
                                                           inputs["image_grid_thw"]).pooler_output)
        assert torch.equal(rows, want)
        positions, _ = hf_model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                     inputs["image_grid_thw"])
        cos, sin_signed = model.lm.rotary.tables(positions[:, 0], torch.float32)
        hcos, hsin = hf_model.model.language_model.rotary_emb(torch.zeros(1, 1, 64), positions)
    half = cos.shape[-1] // 2
    assert torch.equal(cos[:, 0], hcos[0])
    assert torch.equal(sin_signed[:, 0, half:], hsin[0, :, half:])
    assert torch.equal(-sin_signed[:, 0, :half], hsin[0, :, :half])


def test_interleaved_streams() -> None:
    from services.gpu_worker.layers.interleaved_mrope import interleaved_streams

    # Qwen3.5's 32 pairs: height on 1, 4, ..., 31; width on 2, 5, ..., 29; temporal the rest
    streams = interleaved_streams(32, (11, 11, 10))
    assert [i for i, s in enumerate(streams) if s == 1] == list(range(1, 33, 3))
    assert [i for i, s in enumerate(streams) if s == 2] == list(range(2, 30, 3))
    assert interleaved_streams(2, (11, 11, 10)) == [0, 1]  # a tiny partial rotary dim: slices stop at it


def test_the_images_change_transformers_answer(processor: Any, hf_model: Any) -> None:
    """The two images differ in what transformers generates after them: equal tokens in the
    e2e test mean the image rows were right, not ignored."""
    answers = []
    for image in IMAGES[:2]:
        _, inputs = _inputs(processor, [image])
        with torch.no_grad():
            out = hf_model.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
        answers.append(out[0, inputs["input_ids"].shape[1]:].tolist())
    assert answers[0] != answers[1]


def test_the_runner_combines_hybrid_and_mrope_hooks() -> None:
    from services.gpu_worker.build import RUNNERS
    from services.gpu_worker.runners.hybrid import HybridRunner
    from services.gpu_worker.runners.hybrid_vision import HybridVisionRunner
    from services.gpu_worker.runners.mrope import MropeVisionRunner
    from services.gpu_worker.runners.vision import VisionRunner

    assert RUNNERS[Qwen35VLSpec.engine][0] is HybridVisionRunner
    resolved = {name: next(c for c in HybridVisionRunner.__mro__ if name in c.__dict__)
                for name in ("execute", "_metadata", "_backend", "call_model", "make_request", "positions",
                             "prepare", "SPEC", "position_streams")}
    assert resolved == {"execute": HybridRunner, "_metadata": HybridRunner, "_backend": HybridRunner,
                        "call_model": VisionRunner, "make_request": MropeVisionRunner,
                        "positions": MropeVisionRunner, "prepare": MropeVisionRunner, "SPEC": MropeVisionRunner,
                        "position_streams": MropeVisionRunner}


def test_a_folder_without_image_settings_is_served_as_text(folder: Path, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare)
    (bare / "preprocessor_config.json").unlink()
    spec = ModelSource(str(bare)).spec(page_size=8)
    assert isinstance(spec, Qwen35VLSpec) and spec.image_placeholder == ""
    with pytest.raises(PromptError, match="served as text only"):
        spec.prepare_image(_png(IMAGES[0]))
    out = spec.process_prompt(PromptRequest(token_ids=[5, 6, 7]))
    assert out.new_input_tensors["mrope_positions"].tolist() == [[0, 1, 2]] * 3 and out.metadata["mrope_delta"] == 0


def test_tower_and_rope_at_qwen35_08b_widths(processor: Any) -> None:
    """The tower and the text RoPE at Qwen3.5-0.8B's widths (vision hidden 768 in 12 heads of
    64, 2304 learned positions; text head_dim 256, a quarter rotary: 32 pairs over sections
    [11, 11, 10]), one block and one layer, random weights: rows and tables bit for bit."""
    import transformers

    from services.gpu_worker.modeling.hybrid.qwen3_5_vision import Qwen35VLModel

    text = dict(vocab_size=processor.tokenizer.vocab_size + 8, hidden_size=1024, intermediate_size=512,
                num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                layer_types=["full_attention"], rope_parameters={
                    "rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                    "mrope_section": [11, 11, 10], "mrope_interleaved": True})
    vision = dict(depth=1, hidden_size=768, intermediate_size=3072, num_heads=12, patch_size=16,
                  out_hidden_size=1024, num_position_embeddings=2304, initializer_range=0.05)
    cfg = transformers.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(3)
    hf = transformers.Qwen3_5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "visual" in name and (name.endswith(".bias") or "pos_embed" in name):
                param.normal_(0.0, 0.05)
    with torch.device("meta"):
        ours = Qwen35VLModel(cfg.to_dict())
    ours.load_weights({k: v.clone() for k, v in hf.state_dict().items()})
    ours.reset_buffers()
    _, inputs = _inputs(processor, IMAGES)
    with torch.inference_mode():
        rows = ours.encode_images(inputs["pixel_values"], inputs["image_grid_thw"])
        want = torch.cat(hf.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output)
        assert torch.equal(rows, want)
        positions, _ = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                               inputs["image_grid_thw"])
        cos, _ = ours.lm.rotary.tables(positions[:, 0], torch.float32)
        hcos, _ = hf.model.language_model.rotary_emb(torch.zeros(1, 1, 1024), positions)
    assert cos.shape[-1] == 64 and torch.equal(cos[:, 0], hcos[0])
