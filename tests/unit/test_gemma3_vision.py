"""Gemma 3 with images against transformers: shared.vision.gemma3's pixels (bit for bit) and
prompt text against `AutoProcessor`, and greedy tokens of the real path (the data worker's
`prepare`, the vision runner, chunked prefill that keeps each image's bidirectional block
whole, the KV debug checks) against `AutoModelForImageTextToText.generate`, on a tiny random
checkpoint made here."""

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

from services.data_worker.data_worker import DataWorker
from services.gpu_worker.build import build_engine
from services.gpu_worker.kv_manager import KVManager
from services.gpu_worker.modeling.registry import torch_model_for
from services.gpu_worker.modeling.vision.gemma3 import Gemma3VisionLM
from services.gpu_worker.weights import build_model
from shared.frames import GenerateRequest, NewRequest, SamplingParams, pack_tensors
from shared.model_source import ModelSource
from shared.specs.registry import spec_factory
from shared.specs.vision_lm import Gemma3VisionSpec
from shared.vision.gemma3 import Gemma3Images
from tests.vlm_checkpoints import GEMMA3_MM_TOKENS, load_processor, make_gemma3_vlm_checkpoint, png_bytes

MAX_TOKENS = 10


def _noise(width: int, height: int, mode: str, seed: int) -> Image.Image:
    """Random pixels (every resize error shows in them) in `mode`."""
    rng = np.random.default_rng(seed)
    if mode == "RGBA":
        return Image.fromarray(rng.integers(0, 256, (height, width, 4), dtype=np.uint8), "RGBA")
    rgb = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
    return rgb.quantize(colors=16) if mode == "P" else rgb.convert(mode)



@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gemma3_vlm_checkpoint(tmp_path_factory.mktemp("gemma3") / "model")


@pytest.fixture(scope="module")
def processor(folder: Path) -> Any:
    return load_processor(folder)


# -- preprocessing -------------------------------------------------------------------------


def test_settings_read_from_the_folder(folder: Path, processor: Any) -> None:
    settings = Gemma3Images.from_folder(folder)
    ip = processor.image_processor
    assert type(ip).__name__ == "Gemma3ImageProcessorPil"
    assert (settings.height, settings.width) == (ip.size["height"], ip.size["width"]) == (32, 32)
    assert settings.resample == int(ip.resample) and settings.image_seq_length == processor.image_seq_length
    assert settings.prompt() == processor.full_image_sequence
    assert settings.boi_token == processor.boi_token


@pytest.mark.parametrize(("width", "height", "mode"), [(100, 40, "RGB"), (20, 30, "L"), (64, 64, "RGBA"),
                                                       (33, 97, "P"), (32, 32, "RGB"), (3, 70, "LA"),
                                                       (300, 200, "RGB")])
def test_pixel_values_equal_the_processors(folder: Path, processor: Any, width: int, height: int, mode: str) -> None:
    image = _noise(width, height, "RGBA" if mode == "LA" else mode, seed=width)
    image = image.convert("LA") if mode == "LA" else image
    want = processor.image_processor(images=[image], return_tensors="np")["pixel_values"]
    got = Gemma3Images.from_folder(folder).preprocess(image)
    assert got.dtype == np.float32 and got.shape == want.shape == (1, 3, 32, 32)
    assert np.array_equal(got, want)


def _messages(images: int, text: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image"}, {"type": "text", "text": text}]
    if images == 2:
        parts.append({"type": "image"})
    return [{"role": "user", "content": parts}]


@pytest.mark.parametrize("images", [1, 2])
def test_token_ids_equal_the_processors(folder: Path, processor: Any, images: int) -> None:
    text = processor.apply_chat_template(_messages(images, "Describe it."), add_generation_prompt=True)
    pil = [_noise(40 + i, 30, "RGB", i) for i in range(images)]
    want = processor(text=[text], images=[pil], return_tensors="np", add_special_tokens=False)["input_ids"][0]
    settings = Gemma3Images.from_folder(folder)
    parts = text.split(settings.boi_token)
    expanded = parts[0] + "".join(settings.prompt() + part for part in parts[1:])
    got = processor.tokenizer(expanded, add_special_tokens=False)["input_ids"]
    assert got == want.tolist()
    assert got.count(processor.tokenizer.convert_tokens_to_ids("\n\n\n")) > 0  # the newlines merged


def test_hub_layout_pan_and_scan_and_settings_key(folder: Path, tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    shutil.copytree(folder, hub)
    processor_config = json.loads((hub / "processor_config.json").read_text())
    (hub / "preprocessor_config.json").write_text(json.dumps(processor_config.pop("image_processor")))
    (hub / "processor_config.json").write_text(json.dumps(processor_config))
    assert Gemma3Images.from_folder(hub) == Gemma3Images.from_folder(folder)
    image = json.loads((hub / "preprocessor_config.json").read_text())
    (hub / "preprocessor_config.json").write_text(json.dumps({**image, "do_pan_and_scan": True}))
    with pytest.raises(ValueError, match="do_pan_and_scan"):
        Gemma3Images.from_folder(hub)
    (hub / "preprocessor_config.json").write_text(json.dumps({**image, "size": {"height": 64, "width": 64}}))
    with pytest.raises(ValueError, match="vision tower"):
        Gemma3Images.from_folder(hub)
    base = Gemma3Images.from_folder(folder)
    assert base.settings_key() != Gemma3Images(**{**base.__dict__, "resample": 3}).settings_key()
    assert base.settings_key() == Gemma3Images(**{**base.__dict__, "image_seq_length": 8}).settings_key()


def test_registered_spec_and_model(folder: Path) -> None:
    spec = ModelSource(str(folder)).spec(4)
    assert isinstance(spec, Gemma3VisionSpec) and spec_factory("Gemma3ForConditionalGeneration") is Gemma3VisionSpec
    assert torch_model_for(spec) is Gemma3VisionLM
    assert spec.rows_per_tile == GEMMA3_MM_TOKENS and spec.image_placeholder == "<start_of_image>"
    assert [lab.window for lab in spec.kv_labels] == [None, 8]


# -- greedy tokens through the engine ------------------------------------------------------

#: (images, text): one image, two images, an image then text longer than the window (8)
CASES = [(1, "What is in this image?"), (2, "What is in this image?"),
         (1, "Describe the picture in detail, and then say what colour it is. " * 3)]


@pytest.fixture(scope="module")
def references(folder: Path, processor: Any) -> list[tuple[str, list[bytes], list[int], list[int], list[int]]]:
    """Per case: the templated prompt, its PNG files, transformers' input ids, its greedy
    tokens, and its greedy tokens without token_type_ids (plain causal image tokens)."""
    import transformers

    hf = transformers.AutoModelForImageTextToText.from_pretrained(folder).eval()
    hf.generation_config.eos_token_id = None  # every token, as the engine's ignore_eos
    out = []
    for i, (images, text) in enumerate(CASES):
        prompt = processor.apply_chat_template(_messages(images, text), add_generation_prompt=True)
        files = [png_bytes(_noise(100 - 60 * j, 40 + 7 * i, "RGB", 10 * i + j)) for j in range(images)]
        pil = [Image.open(io.BytesIO(f)).convert("RGB") for f in files]
        inputs = processor(text=[prompt], images=[pil], return_tensors="pt", add_special_tokens=False)
        n = inputs["input_ids"].shape[1]
        causal = {k: v for k, v in inputs.items() if k != "token_type_ids"}
        with torch.no_grad():
            want = hf.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)[0, n:].tolist()
            plain = hf.generate(**causal, max_new_tokens=MAX_TOKENS, do_sample=False)[0, n:].tolist()
        out.append((prompt, files, inputs["input_ids"][0].tolist(), want, plain))
    return out


def test_the_image_blocks_change_transformers_tokens(references: list) -> None:
    """The parity below is a test of the bidirectional rule: at least one case's tokens
    differ when transformers treats image tokens causally."""
    assert any(want != plain for _, _, _, want, plain in references)


def _prepared(spec: Any, src: ModelSource, prompt: str, files: list[bytes]) -> tuple[list[int], Any]:
    """The data worker's `prepare` (expansion, one tokenization, process_prompt)."""
    dw = DataWorker.__new__(DataWorker)
    dw.spec, dw.tok, dw.vocab_size = spec, src.tokenizer, src.tokenizer.tokenizer.get_vocab_size()
    req = GenerateRequest("r", "m", SamplingParams(temperature=0.0, ignore_eos=True), "x", MAX_TOKENS, prompt=prompt,
                          add_special_tokens=False, images=files)
    ids, ppo, _ = dw.prepare(req)
    return ids, ppo


@pytest.mark.parametrize("budget", [256, 5, 3])
def test_greedy_tokens_equal_transformers(folder: Path, references: list, budget: int) -> None:
    """Every case at once in one engine; a budget of 5 chunks the prompts around the
    4-row image blocks, 3 is shorter than a block (which then runs whole, over it)."""
    src = ModelSource(str(folder))
    spec = src.spec(4)
    model = build_model(src, spec, torch.float32)
    pools = spec.paged_pools(96)
    caches = {n: [torch.zeros(p.num_pages, 2, p.page_size, p.kv_heads, p.head_dim) for _ in range(p.num_layers)]
              for n, p in pools.items()}
    kv = KVManager(pools, spec.kv_labels)
    kv.debug = True
    eng = build_engine(model, spec, kv, caches, eos_ids=[], max_num_seqs=4, max_batch_tokens=budget,
                       max_seq_len=spec.max_seq_len)
    caps = spec.clamp_caps(spec.get_loop_caps(MAX_TOKENS))
    blocks = {}
    for i, (prompt, files, want_ids, _, _) in enumerate(references):
        ids, ppo = _prepared(spec, src, prompt, files)
        assert ids == want_ids
        refs, _ = pack_tensors(ppo.new_input_tensors)
        eng.add(NewRequest(f"r{i}", "", refs, SamplingParams(temperature=0.0, ignore_eos=True), "", len(ids),
                           MAX_TOKENS, ppo.kv_layout, caps, spec.kv_configs(ppo.kv_layout, caps, pools)),
                ppo.new_input_tensors)
        blocks[f"r{i}"] = eng.scheduler.ids[f"r{i}"].kv.blocks
        assert len(blocks[f"r{i}"]) == len(files) and all(e - s == GEMMA3_MM_TOKENS for s, e in blocks[f"r{i}"])
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(references))}
    chunk_ends: list[tuple[str, int]] = []
    schedule = eng.scheduler.schedule

    def recorded() -> Any:  # each plan's prompt chunks: where they end
        plan = schedule()
        chunk_ends.extend((e.request.request_id, e.request.num_computed + e.rows) for e in plan.entries if not e.decode)
        return plan

    eng.scheduler.schedule = recorded  # type: ignore[method-assign]
    while eng.has_work:
        for _, out in eng.step().outputs:
            got[out.request_id].extend(out.token_ids)
    assert [got[f"r{i}"] for i in range(len(references))] == [ref[3] for ref in references]
    assert all(not (s < end < e) for rid, end in chunk_ends for s, e in blocks[rid])
    assert (len(chunk_ends) == len(references)) == (budget == 256)
    assert kv.used_pages() == 0 and kv.footprint_overruns == 0
