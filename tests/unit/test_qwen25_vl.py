"""Qwen2.5-VL against transformers, on a tiny random checkpoint made here: the image half of
its processor (pixel values bit for bit, grids, prompt expansion and token ids), the M-RoPE
positions of `get_rope_index`, the vision tower's rows and M-RoPE tables bit for bit, and
greedy generation through the engine (chunked prefill of 16 rows, KV debug checks on, every
page back) equal to transformers' `generate`: one image, two images, an image then long
text, the three batched together, and the same image again from the prefix cache."""

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

from shared.frames import GenerateRequest, NewRequest, SamplingParams, pack_tensors, unpack_tensors
from shared.model_source import ModelSource
from shared.specs.base import PromptError
from shared.specs.vision_lm import Qwen25VLSpec, mrope_positions
from shared.vision.qwen2_vl import Qwen2VLImages, smart_resize
from tests.vlm_checkpoints import make_qwen25_vl_checkpoint, png_bytes, qwen25_vl_processor

MAX_TOKENS = 12
LONG_TEXT = " ".join(["Serving engines batch requests and page their KV cache."] * 12)

#: (width, height, mode): several sizes and aspect ratios, up- and downscaled by smart_resize
IMAGES = {
    "landscape": (100, 40, "RGB"), "portrait": (20, 30, "RGB"), "tall": (33, 97, "RGB"),
    "large": (640, 480, "RGB"), "thin": (7, 300, "RGB"), "square": (96, 96, "RGB"), "tiny": (17, 17, "RGB"),
    "wide": (1000, 12, "RGB"), "rgba": (50, 30, "RGBA"), "grayscale": (45, 60, "L"),
}


def _noise(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """Random pixels (every resize error shows in them) in `mode`."""
    rng = np.random.default_rng(seed)
    if mode == "RGBA":
        return Image.fromarray(rng.integers(0, 256, (height, width, 4), dtype=np.uint8), "RGBA")
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB").convert(mode)



@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen25_vl_checkpoint(tmp_path_factory.mktemp("qwen25vl") / "ckpt")


@pytest.fixture(scope="module")
def processor(folder: Path) -> Any:
    return qwen25_vl_processor(folder)


@pytest.fixture(scope="module")
def hf_model(folder: Path) -> Any:
    import transformers

    return transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(folder).eval()


@pytest.fixture(scope="module")
def source(folder: Path) -> ModelSource:
    return ModelSource(str(folder))


# -- preprocessing -------------------------------------------------------------------------


def test_settings_read_from_the_folder(folder: Path) -> None:
    images = Qwen2VLImages.from_folder(folder)
    assert (images.min_pixels, images.max_pixels, images.patch_size, images.merge_size) == (1024, 9216, 8, 2)
    assert images.resample == 3 and images.temporal_patch_size == 2 and images.image_token == "<|image_pad|>"


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_pixel_values_and_grid_equal_the_processors(folder: Path, processor: Any, name: str) -> None:
    width, height, mode = IMAGES[name]
    image = _noise(width, height, mode, seed=len(name))
    ref = processor.image_processor(images=[image], return_tensors="np")
    pixels, grid = Qwen2VLImages.from_folder(folder).preprocess(image)
    assert [list(grid)] == ref["image_grid_thw"].tolist()
    assert pixels.dtype == np.float32 and np.array_equal(pixels, ref["pixel_values"])


@pytest.mark.parametrize("size", [(28, 28), (100, 40), (999, 1), (3, 7), (4000, 3000), (56, 57)])
def test_smart_resize_equals_transformers(size: tuple[int, int]) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as ref

    for factor, lo, hi in ((28, 56 * 56, 28 * 28 * 1280), (16, 1024, 9216)):
        try:
            want: Any = ref(*size, factor=factor, min_pixels=lo, max_pixels=hi)
        except ValueError:
            want = ValueError
        if want is ValueError:
            with pytest.raises(ValueError):
                smart_resize(*size, factor, lo, hi)
        else:
            assert smart_resize(*size, factor, lo, hi) == want


def test_nested_processor_config_and_pixel_bounds(folder: Path, tmp_path: Path) -> None:
    """transformers 5's processor_config.json (the image processor's settings nested) and
    the Hub's min_pixels / max_pixels, which win over `size`."""
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, tmp_path / name)
    saved = json.loads((folder / "preprocessor_config.json").read_text())
    saved.update(min_pixels=2048, max_pixels=4096)
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": saved}))
    images = Qwen2VLImages.from_folder(tmp_path)
    assert (images.min_pixels, images.max_pixels) == (2048, 4096)
    assert images.settings_key() != Qwen2VLImages.from_folder(folder).settings_key()


def test_a_processor_other_than_the_tower_is_refused(folder: Path, tmp_path: Path) -> None:
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    saved = json.loads((folder / "preprocessor_config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(dict(saved, patch_size=14)))
    with pytest.raises(ValueError, match="patch_size"):
        Qwen2VLImages.from_folder(tmp_path)


def _prepare(source: ModelSource, text: str, images: list[bytes]) -> tuple[list[int], Any, dict]:
    from services.data_worker.data_worker import DataWorker

    worker = DataWorker.__new__(DataWorker)
    worker.spec, worker.tok = source.spec(16), source.tokenizer
    worker.vocab_size = source.tokenizer.tokenizer.get_vocab_size()
    req = GenerateRequest("r", "m", SamplingParams(temperature=0.0, ignore_eos=True), "x", MAX_TOKENS, prompt=text,
                          add_special_tokens=False, images=images)
    return worker.prepare(req)


#: the prompts the parity tests run: (user content parts, image sizes)
CASES = {
    "one_image": ([{"type": "image"}, {"type": "text", "text": "What is in this image?"}], [(100, 40)]),
    "two_images": ([{"type": "image"}, {"type": "text", "text": "Compare it with"}, {"type": "image"},
                    {"type": "text", "text": "please."}], [(96, 96), (20, 30)]),
    "image_then_long_text": ([{"type": "image"}, {"type": "text", "text": LONG_TEXT}], [(33, 97)]),
}


def _case(processor: Any, name: str) -> tuple[str, list[bytes], dict[str, torch.Tensor]]:
    """(the templated prompt, the image files, the processor's tensors for them)."""
    parts, sizes = CASES[name]
    text = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)
    files = [png_bytes(_noise(w, h, seed=i)) for i, (w, h) in enumerate(sizes)]
    pil = [Image.open(io.BytesIO(f)).convert("RGB") for f in files]
    return text, files, processor(text=[text], images=pil, return_tensors="pt")


@pytest.mark.parametrize("name", sorted(CASES))
def test_token_ids_tensors_and_positions_equal_transformers(source: ModelSource, processor: Any, hf_model: Any,
                                                            name: str) -> None:
    text, files, inputs = _case(processor, name)
    ids, ppo, metadata = _prepare(source, text, files)
    tensors = ppo.new_input_tensors
    assert ids == inputs["input_ids"][0].tolist()
    assert np.array_equal(tensors["pixel_values"], inputs["pixel_values"].numpy())
    assert np.array_equal(tensors["image_grid_thw"], inputs["image_grid_thw"].numpy())
    positions, delta = hf_model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                     image_grid_thw=inputs["image_grid_thw"])
    assert np.array_equal(tensors["mrope_positions"], positions[:, 0].numpy())
    assert metadata["mrope_delta"] == ppo.metadata["mrope_delta"] == int(delta)
    rows = [s.length for s in ppo.kv_layout["text"].spans if s.kind == "rows"]
    assert rows == (inputs["image_grid_thw"].prod(-1) // 4).tolist()


def test_mrope_positions_of_text_and_refusals() -> None:
    positions, delta = mrope_positions([5, 6, 7], 9, [], 2)
    assert positions.tolist() == [[0, 1, 2]] * 3 and delta == 0
    # two images back to back are two grids; a grid of 1 x 2 x 4 patches is 1 x 1 x 2 tokens
    positions, delta = mrope_positions([1, 9, 9, 9, 1], 9, [(1, 2, 4), (1, 2, 2)], 2)
    assert positions.tolist() == [[0, 1, 1, 3, 4], [0, 1, 1, 3, 4], [0, 1, 2, 3, 4]] and delta == 0
    with pytest.raises(PromptError, match="not one run"):  # an image's two tokens split by text
        mrope_positions([9, 1, 9], 9, [(1, 2, 4)], 2)
    with pytest.raises(PromptError, match="more image tokens"):
        mrope_positions([9, 9, 9], 9, [(1, 2, 4)], 2)


# -- the vision tower and M-RoPE tables ------------------------------------------------------


def _engine_model(source: ModelSource) -> Any:
    from services.gpu_worker.weights import build_model

    return build_model(source, source.spec(16), torch.float32)


def test_vision_tower_rows_equal_transformers(source: ModelSource, processor: Any, hf_model: Any) -> None:
    """Several images in one pass, windows cut at the edges, bit for bit."""
    images = [_noise(w, h, seed=i) for i, (w, h) in enumerate([(100, 40), (20, 30), (96, 96), (640, 480)])]
    inputs = processor.image_processor(images=images, return_tensors="pt")
    model = _engine_model(source)
    with torch.inference_mode():
        ref = torch.cat(hf_model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
                        .pooler_output)
        got = model.encode_images(inputs["pixel_values"], inputs["image_grid_thw"])
    assert torch.equal(got, ref)


def test_mrope_tables_equal_transformers(source: ModelSource, hf_model: Any) -> None:
    model = _engine_model(source)
    positions = torch.randint(0, 900, (3, 57), generator=torch.Generator().manual_seed(0))
    cos, sin = hf_model.model.language_model.rotary_emb(torch.zeros(1), positions[:, None, :])
    rotary = next(iter(model.lm.rotaries.values()))
    my_cos, my_sin = rotary.tables(positions, torch.float32)
    half = my_cos.shape[-1] // 2
    assert torch.equal(my_cos[:, 0], cos[0])
    assert torch.equal(-my_sin[:, 0, :half], sin[0, :, :half]) and torch.equal(my_sin[:, 0, half:], sin[0, :, half:])
    flat = torch.arange(40)  # a text row's three equal positions: the 1-D table
    assert all(torch.equal(a, b) for a, b in zip(rotary.tables(flat, torch.float32),
                                                 rotary.tables(flat.expand(3, -1), torch.float32)))


# -- generation through the engine ----------------------------------------------------------


def _reference(hf_model: Any, inputs: dict[str, torch.Tensor]) -> list[int]:
    with torch.no_grad():
        # no stop token (the engine's requests ignore EOS): every step's argmax, as the engine's
        out = hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def _engine(source: ModelSource, max_batch_tokens: int = 16) -> tuple[Any, Any, Any, dict]:
    from services.gpu_worker.build import build_engine
    from services.gpu_worker.kv_manager import KVManager

    spec = source.spec(16)
    model = _engine_model(source)
    pools = spec.paged_pools(96)
    caches = {n: [torch.zeros(p.num_pages, 2, p.page_size, p.kv_heads, p.head_dim) for _ in range(p.num_layers)]
              for n, p in pools.items()}
    kv = KVManager(pools, spec.kv_labels)
    kv.debug = True
    engine = build_engine(model, spec, kv, caches, eos_ids=[], max_num_seqs=4, max_batch_tokens=max_batch_tokens,
                          max_seq_len=spec.max_seq_len)
    return spec, kv, engine, pools


def _add(engine: Any, spec: Qwen25VLSpec, pools: dict, rid: str, prepared: tuple[list[int], Any, dict]) -> None:
    ids, ppo, metadata = prepared
    caps = spec.clamp_caps(spec.get_loop_caps(MAX_TOKENS))
    refs, buffers = pack_tensors(ppo.new_input_tensors)
    tensors = unpack_tensors(refs, [memoryview(b.tobytes()) for b in buffers])  # read-only, as a worker gets them
    engine.add(NewRequest(rid, "", refs, SamplingParams(temperature=0.0, ignore_eos=True), "", len(ids), MAX_TOKENS,
                          ppo.kv_layout, caps, spec.kv_configs(ppo.kv_layout, caps, pools), metadata=metadata),
               tensors)


def _run(engine: Any) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    while engine.has_work:
        step = engine.step()
        assert not step.errors, step.errors
        for _, out in step.outputs:
            got.setdefault(out.request_id, []).extend(out.token_ids)
    return got


@pytest.mark.parametrize("name", sorted(CASES))
def test_generation_equals_transformers(source: ModelSource, processor: Any, hf_model: Any, name: str) -> None:
    text, files, inputs = _case(processor, name)
    spec, kv, engine, pools = _engine(source)
    _add(engine, spec, pools, name, _prepare(source, text, files))
    assert _run(engine) == {name: _reference(hf_model, inputs)}
    assert kv.used_pages() == 0


def test_batched_requests_and_a_prefix_cache_hit(source: ModelSource, processor: Any, hf_model: Any) -> None:
    """The three prompts in one batch (their positions side by side in a step), then the
    first again: its image's rows come from the prefix cache (not encoded), its positions
    still from its own tensor."""
    spec, kv, engine, pools = _engine(source, max_batch_tokens=32)
    want = {}
    for name in CASES:
        text, files, inputs = _case(processor, name)
        want[name] = _reference(hf_model, inputs)
        _add(engine, spec, pools, name, _prepare(source, text, files))
    assert _run(engine) == want
    text, files, _ = _case(processor, "image_then_long_text")
    encoded: list[int] = []
    tower = engine.runner.model.vision
    hook = tower.register_forward_hook(lambda _m, args, _out: encoded.append(len(args[1])))
    _add(engine, spec, pools, "again", _prepare(source, text, files))
    assert _run(engine) == {"again": want["image_then_long_text"]}
    hook.remove()
    assert encoded == []  # every image row was in the prefix cache
    assert kv.used_pages() == 0


def test_a_prefix_cache_hit_that_ends_inside_an_image(source: ModelSource, processor: Any, hf_model: Any) -> None:
    """The same image under another question: the cached pages end inside the image's rows
    (its 30 rows start at row 37; pages of 16), so the image is encoded again and only its
    rows past the hit are used."""
    spec, kv, engine, pools = _engine(source)
    image = png_bytes(_noise(128, 96, seed=7))
    encoded: list[int] = []
    hook = engine.runner.model.vision.register_forward_hook(lambda _m, args, _out: encoded.append(len(args[1])))
    computed: list[int] = []  # each request's rows in KV (the prefix cache's) when its image is encoded
    encode = engine.runner._encode
    engine.runner._encode = lambda reqs: (computed.extend(r.num_computed for r in reqs), encode(reqs))
    for i, question in enumerate(("What is this?", "Describe it in a few words.")):
        parts = [{"type": "image"}, {"type": "text", "text": question}]
        text = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)
        inputs = processor(text=[text], images=[Image.open(io.BytesIO(image)).convert("RGB")], return_tensors="pt")
        assert inputs["input_ids"][0].tolist().index(spec.image_token_id) == 37
        assert inputs["image_grid_thw"].tolist() == [[1, 10, 12]]
        _add(engine, spec, pools, f"q{i}", _prepare(source, text, [image]))
        assert _run(engine) == {f"q{i}": _reference(hf_model, inputs)}
    hook.remove()
    assert encoded == [1, 1] and computed == [0, 64] and kv.used_pages() == 0


def _hub_form(folder: Path, target: Path) -> Path:
    """The checkpoint as the Hub's Qwen2.5-VL files have it (transformers 4's save): the text
    config flat at the top with rope_scaling {"type": "mrope"} and rope_theta beside it, and
    the weights named `visual.*`, `model.*` (the LM) and `lm_head.*`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, target)
    config = json.loads((folder / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    config.update({k: v for k, v in text.items() if k not in ("model_type", "layer_types")})
    config.update(rope_theta=rope["rope_theta"], rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]})
    (target / "config.json").write_text(json.dumps(config))
    state = load_file(str(folder / "model.safetensors"))
    renamed = {k.replace("model.visual.", "visual.").replace("model.language_model.", "model."): v
               for k, v in state.items()}
    save_file(renamed, str(target / "model.safetensors"))
    return target


def test_the_hubs_flat_config_and_weight_names(source: ModelSource, folder: Path, processor: Any, hf_model: Any,
                                               tmp_path: Path) -> None:
    hub = ModelSource(str(_hub_form(folder, tmp_path / "hub")))
    spec, nested = hub.spec(16), source.spec(16)
    assert isinstance(spec, Qwen25VLSpec) and spec.config == nested.config
    assert spec.mrope_section == nested.mrope_section == (2, 3, 3)
    text, files, inputs = _case(processor, "two_images")
    spec, kv, engine, pools = _engine(hub)
    _add(engine, spec, pools, "hub", _prepare(hub, text, files))
    assert _run(engine) == {"hub": _reference(hf_model, inputs)}
    assert kv.used_pages() == 0
