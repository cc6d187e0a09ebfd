"""WorldSpec (V-JEPA 2-AC) without the services: the layout of a rollout (a rows span of
every frame the predictor takes), the refusals naming the field, the clip's content key."""

from __future__ import annotations

import io

import numpy as np
import pytest

from shared.specs.base import PromptError, PromptRequest
from shared.specs.world import WorldSpec
from tests.world_checkpoints import ACTION_DIM, ENCODER, IMG, PREDICTOR, TOKENS


def spec() -> WorldSpec:
    return WorldSpec({"architectures": ["VJEPA2ACWorldModel"], "encoder": ENCODER, "predictor": PREDICTOR},
                     page_size=8)


def png(seed: int, size: int = IMG) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def request(s: WorldSpec, frames: int, steps: int, rows: int | None = None) -> PromptRequest:
    n = frames + steps - 1 if rows is None else rows
    images = tuple(s.prepare_image(png(i)) for i in range(frames))
    zeros = (0.0,) * (n * ACTION_DIM)
    return PromptRequest([], images=images, floats={"actions": zeros, "states": zeros},
                         options={"steps": steps, "actions_rows": n, "states_rows": n})


def test_layout_is_every_frame_the_predictor_takes():
    s = spec()
    ppo = s.process_prompt(request(s, 2, 3))
    rows = 4 * (TOKENS + 2)
    assert ppo.metadata["prompt_len"] == rows and ppo.kv_layout["frames"].spans[0].length == rows
    assert ppo.new_input_tensors["pixel_values"].shape == (2, 3, IMG, IMG)
    assert ppo.new_input_tensors["actions"].shape == (4, ACTION_DIM)
    assert s.world_shape == (TOKENS, ENCODER["embed_dim"])


def test_refusals_name_the_field():
    s = spec()
    with pytest.raises(PromptError) as exc:
        s.process_prompt(request(s, 2, 3, rows=3))
    assert exc.value.param == "actions"
    with pytest.raises(PromptError) as exc:
        s.process_prompt(request(s, 2, 0))
    assert exc.value.param == "steps"
    with pytest.raises(PromptError) as exc:
        s.process_prompt(request(s, 2, s.max_frames))
    assert exc.value.param == "steps"
    with pytest.raises(PromptError) as exc:
        s.prepare_image(b"not an image")
    assert exc.value.param == "frames"


def test_clip_key_is_the_frames_in_order():
    s = spec()
    a, b = s.prepare_image(png(1)), s.prepare_image(png(2))
    assert s.clip_key((a, b)) == s.clip_key((s.prepare_image(png(1)), s.prepare_image(png(2))))
    assert s.clip_key((a, b)) != s.clip_key((b, a)) != s.clip_key((a,))


def test_frames_resized_and_normalized():
    s = spec()
    pixels = s.prepare_image(png(3, size=2 * IMG)).pixels
    assert pixels.shape == (1, 3, IMG, IMG) and pixels.dtype == np.float32
