"""shared.vision.idefics3 against transformers' own Idefics3 / SmolVLM processors: the pixel
values of every image (bit for bit), the text that replaces each <image> placeholder, and the
token ids of prompts with one and two images; read from tiny checkpoints made here."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from tokenizers import Tokenizer

from shared.vision.idefics3 import Idefics3Images
from tests.vlm_checkpoints import IMAGE_SEQ_LEN, load_processor, make_idefics3_checkpoint

FAMILIES = ("idefics3", "smolvlm")


def _noise(width: int, height: int, mode: str, seed: int) -> Image.Image:
    """Random pixels (every resize error shows in them) in `mode`."""
    rng = np.random.default_rng(seed)
    if mode in ("RGBA", "LA"):
        pixels = rng.integers(0, 256, (height, width, 4), dtype=np.uint8)
        return Image.fromarray(pixels, "RGBA").convert(mode)
    rgb = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
    if mode == "P":
        return rgb.quantize(colors=16)
    if mode == "P+transparency":  # a palette image with one transparent index, as GIFs have
        image = rgb.quantize(colors=16)
        image.info["transparency"] = 3
        return image
    return rgb.convert(mode)


IMAGES = {
    "tiny": (10, 7, "RGB"),
    "tile": (32, 32, "RGB"),
    "landscape": (100, 40, "RGB"),
    "portrait": (37, 90, "RGB"),
    "large": (300, 200, "RGB"),
    "thin": (3, 70, "RGB"),
    "rgba": (50, 30, "RGBA"),
    "la": (20, 44, "LA"),
    "grayscale": (45, 60, "L"),
    "palette": (64, 48, "P"),
    "palette_transparent": (33, 65, "P+transparency"),
}
#: processor call kwargs, and the same settings for Idefics3Images: the checkpoint's
#: (every image upscales to 64 px, so 2 x 2 tiles at most), one tile (64 -> 32 px: (0, 0)),
#: no splitting, and a 3 x 3 grid with another filter
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "saved": ({}, {}),
    "one_tile": ({"size": {"longest_edge": 32}}, {"longest_edge": 32}),
    "no_split": ({"do_image_splitting": False}, {"do_image_splitting": False}),
    "bicubic_3x3": ({"size": {"longest_edge": 96}, "resample": 3}, {"longest_edge": 96, "resample": 3}),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vlm")
    return {family: make_idefics3_checkpoint(root / family, family) for family in FAMILIES}


@pytest.fixture(scope="module")
def processors(folders: dict[str, Path]) -> dict[str, Any]:
    return {family: load_processor(folder) for family, folder in folders.items()}


def test_settings_read_from_the_folder(folders: dict[str, Path], processors: dict[str, Any]) -> None:
    for family, folder in folders.items():
        settings = Idefics3Images.from_folder(folder)
        proc = processors[family]
        assert type(proc.image_processor).__name__.endswith("ImageProcessorPil")
        assert settings.processor_class == type(proc).__name__
        assert (settings.longest_edge, settings.tile_size, settings.resample) == (64, 32, 1)
        assert settings.image_seq_len == proc.image_seq_len == IMAGE_SEQ_LEN == 4
        assert settings.image_token == proc.image_token == "<image>"
        assert settings.fake_image_token == proc.fake_image_token
        assert settings.rescale_factor == proc.image_processor.rescale_factor
        assert settings.image_mean == tuple(proc.image_processor.image_mean)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_pixel_values_equal_the_processors(folders: dict[str, Path], processors: dict[str, Any],
                                           family: str, variant: str) -> None:
    call_kwargs, overrides = VARIANTS[variant]
    settings = dataclasses.replace(Idefics3Images.from_folder(folders[family]), **overrides)
    grids = set()
    for seed, (name, (width, height, mode)) in enumerate(IMAGES.items()):
        image = _noise(width, height, mode, seed)
        ref = processors[family](text="A<image>", images=[[image]], **call_kwargs)
        pixels, rows, cols = settings.preprocess(image)
        expected = np.asarray(ref["pixel_values"][0])
        assert pixels.dtype == np.float32 and expected.dtype == np.float32, name
        assert pixels.shape == expected.shape == (rows * cols + 1, 3, 32, 32), name
        assert np.array_equal(pixels, expected), (name, float(np.abs(pixels - expected).max()))
        assert ref["pixel_attention_mask"][0].all(), name  # one image: nothing padded
        grids.add((rows, cols))
    expected_grids = {"saved": {(2, 2), (1, 2), (2, 1)}, "one_tile": {(0, 0)}, "no_split": {(0, 0)},
                      "bicubic_3x3": {(3, 3), (2, 3), (3, 2), (3, 1)}}[variant]
    assert expected_grids <= grids, grids


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_equals_the_processors_replacement(folders: dict[str, Path], processors: dict[str, Any],
                                                  family: str) -> None:
    settings = Idefics3Images.from_folder(folders[family])
    for rows, cols in [(0, 0), (1, 1), (1, 2), (2, 1), (2, 2), (3, 2), (6, 6)]:
        expected = processors[family].replace_image_token({"rows": [[rows]], "cols": [[cols]]}, image_idx=0)
        assert settings.prompt(rows, cols) == expected
    fake = "<fake_token_around_image>"
    assert settings.prompt(0, 0) == f"{fake}<global-img>{'<image>' * 4}{fake}"
    assert settings.prompt(1, 2) == (
        "<fake_token_around_image><row_1_col_1><image><image><image><image>"
        "<fake_token_around_image><row_1_col_2><image><image><image><image>\n"
        "\n<fake_token_around_image><global-img><image><image><image><image><fake_token_around_image>"
    )


def _expand(text: str, settings: Idefics3Images, grids: list[tuple[int, int]]) -> str:
    """`text` with its placeholders replaced in order, as the data worker will do it."""
    parts = text.split(settings.image_token)
    assert len(parts) == len(grids) + 1
    return parts[0] + "".join(settings.prompt(*grid) + part for grid, part in zip(grids, parts[1:]))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("variant", ["saved", "one_tile"])
def test_token_ids_equal_the_processors(folders: dict[str, Path], processors: dict[str, Any],
                                        family: str, variant: str) -> None:
    call_kwargs, overrides = VARIANTS[variant]
    settings = dataclasses.replace(Idefics3Images.from_folder(folders[family]), **overrides)
    tokenizer = Tokenizer.from_file(str(folders[family] / "tokenizer.json"))
    images = [_noise(100, 40, "RGB", 1), _noise(37, 90, "L", 2)]
    for text, batch in [("User:<image>What is this?<end_of_utterance>\nAssistant:", images[:1]),
                        ("Compare <image> with<image>, please.", images)]:
        ref = processors[family](text=text, images=[batch], **call_kwargs)
        outputs = [settings.preprocess(image) for image in batch]
        ids = tokenizer.encode(_expand(text, settings, [(rows, cols) for _, rows, cols in outputs])).ids
        assert ids == list(ref["input_ids"][0])
        image_id = tokenizer.token_to_id(settings.image_token)
        tiles = sum(len(pixels) for pixels, _, _ in outputs)
        assert ids.count(image_id) == tiles * settings.image_seq_len
        assert np.array_equal(np.concatenate([pixels for pixels, _, _ in outputs]), np.asarray(ref["pixel_values"][0]))


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_template_renders_image_parts_as_the_placeholder(processors: dict[str, Any], family: str) -> None:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    rendered = processors[family].apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    start = {"idefics3": "<|begin_of_text|>", "smolvlm": "<|im_start|>"}[family]
    assert rendered == f"{start}User:<image>What is this?<end_of_utterance>\nAssistant:"
    assert rendered.count(Idefics3Images().image_token) == 1
    assert processors[family].tokenizer.eos_token == "<end_of_utterance>"


def test_hub_layout_and_settings_key(folders: dict[str, Path], tmp_path: Path) -> None:
    """A folder as the Hub has them (preprocessor_config.json, a flat processor_config.json)
    reads the same; the key changes with pixel settings only; a processor whose
    image_seq_len disagrees with the vision tower is refused."""
    saved = Idefics3Images.from_folder(folders["smolvlm"])
    hub = Path(shutil.copytree(folders["smolvlm"], tmp_path / "hub"))
    processor = json.loads((hub / "processor_config.json").read_text())
    image = dict(processor.pop("image_processor"), processor_class="SmolVLMProcessor")
    processor.pop("video_processor")
    (hub / "preprocessor_config.json").write_text(json.dumps(image))
    (hub / "processor_config.json").write_text(json.dumps(processor))
    assert Idefics3Images.from_folder(hub) == saved
    assert Idefics3Images.from_folder(folders["idefics3"]).settings_key() == saved.settings_key()
    assert dataclasses.replace(saved, image_seq_len=9).settings_key() == saved.settings_key()
    for change in [{"tile_size": 64}, {"resample": 3}, {"do_image_splitting": False}, {"image_mean": (0.4,) * 3}]:
        assert dataclasses.replace(saved, **change).settings_key() != saved.settings_key(), change
    (hub / "processor_config.json").write_text(json.dumps(dict(processor, image_seq_len=16)))
    with pytest.raises(ValueError, match="image_seq_len 16"):
        Idefics3Images.from_folder(hub)


def test_without_rgb_conversion(folders: dict[str, Path], processors: dict[str, Any]) -> None:
    """do_convert_rgb off: an RGB image gives the same pixels; one of another channel count
    is refused (ValueError) as transformers refuses it (its mean has 3 values)."""
    settings = dataclasses.replace(Idefics3Images.from_folder(folders["idefics3"]), do_convert_rgb=False)
    image = _noise(100, 40, "RGB", 0)
    ref = processors["idefics3"](text="<image>", images=[[image]], do_convert_rgb=False)
    assert np.array_equal(settings.preprocess(image)[0], np.asarray(ref["pixel_values"][0]))
    for mode in ("RGBA", "L"):
        with pytest.raises(ValueError, match="mean must have"):
            processors["idefics3"](text="<image>", images=[[image.convert(mode)]], do_convert_rgb=False)
        with pytest.raises(ValueError, match="normalization values"):
            settings.preprocess(image.convert(mode))
