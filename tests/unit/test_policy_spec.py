"""The policy spec's processor half against transformers' (no services): a camera's pixels
equal PI0ImageProcessor's on the Pillow backend for images wider, taller, smaller and
larger than its size; Pi0.5's prompt (the state's bins among them, -1 and 255 for values
past the quantiles) and Pi0's normalized state equal the processors'."""

from __future__ import annotations

import io

import numpy as np
import pytest

from shared.specs.policy import Pi05Spec, PolicySpec
from shared.specs.registry import spec_factory
from tests.policy_checkpoints import load_processor, make_pi0_checkpoint


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("policy")
    return {family: make_pi0_checkpoint(root / family, family=family) for family in ("pi0", "pi05")}


def spec_of(folder) -> PolicySpec:
    import json

    config = json.loads((folder / "config.json").read_text())
    spec = spec_factory(config["architectures"][0])(config, page_size=8)
    assert isinstance(spec, PolicySpec)
    return spec.load_folder(folder)


@pytest.mark.parametrize("size", [(40, 20), (18, 36), (28, 28), (10, 12), (90, 70)])
def test_pixels_equal_the_processor(folders, size):
    from PIL import Image

    rng = np.random.default_rng(size[0])
    image = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    buf = io.BytesIO()
    image.save(buf, "PNG")
    want = load_processor(folders["pi0"]).image_processor([image], return_tensors="np")["pixel_values"][0]
    got = spec_of(folders["pi0"]).prepare_image(buf.getvalue()).pixels[0]
    np.testing.assert_array_equal(got, want)


def test_pi05_prompt_and_pi0_state_equal_the_processors(folders):
    import torch

    states = [[0.3, -9.0, 9.0, 0.1, -0.2], [1.5, 0.0, -1.0, 2.2, 0.7]]
    proc, spec = load_processor(folders["pi05"]), spec_of(folders["pi05"])
    assert isinstance(spec, Pi05Spec)
    for state in states:
        text = " pick_up\nthe cube "
        want = proc.build_prompts([text], [[None]], proc.normalize(torch.tensor([state]), "state"))[0]
        assert spec.policy_prompt(text, 1, state) == want
    assert " -1 255 " in spec.policy_prompt("x", 1, states[0])
    proc, spec = load_processor(folders["pi0"]), spec_of(folders["pi0"])
    for state in states:
        want = proc.normalize(torch.tensor(state), "state").numpy()
        np.testing.assert_array_equal(spec.normalized_state(state), want)
