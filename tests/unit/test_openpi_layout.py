"""openpi's example observations (DROID, ALOHA, LIBERO, LeRobot, openpi's model inputs) as
/v1/actions bodies: which key is which camera, state and prompt; refusals name the key."""

from __future__ import annotations

import numpy as np
import pytest

from services.api.errors import ApiError
from services.api.openpi_layout import policy_input, unpack_arrays

SLOTS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")


def img(c_first: bool = False, floats: bool = False) -> np.ndarray:
    arr = np.full((3, 4, 5) if c_first else (4, 5, 3), 0.5 if floats else 7, np.float32 if floats else np.uint8)
    return arr


def test_droid():
    obs = {"observation/exterior_image_1_left": img(), "observation/wrist_image_left": img(),
           "observation/joint_position": np.arange(7, dtype=np.float64), "observation/gripper_position": np.ones(1),
           "prompt": "wipe"}
    got = policy_input(obs, SLOTS[:2])
    assert [c.name for c in got.cameras] == list(SLOTS[:2])
    assert got.body["observation"]["state"] == [0, 1, 2, 3, 4, 5, 6, 1.0] and got.body["prompt"] == "wipe"


def test_aloha_drops_cam_low_and_fills_slots():
    obs = {"images": {"cam_right_wrist": img(True), "cam_low": img(), "cam_high": img(floats=True),
                      "cam_left_wrist": img()}, "state": [0.5] * 14, "prompt": "fold"}
    got = policy_input(obs, SLOTS)
    assert [c.name for c in got.cameras] == list(SLOTS)
    assert got.cameras[0].pixels.dtype == np.uint8 and int(got.cameras[0].pixels[0, 0, 0]) == 127
    assert got.cameras[2].pixels.shape == (4, 5, 3)  # CHW moved to HWC


def test_any_cameras_in_order_sent():
    obs = {"observation/wrist_image": img(), "observation/image": img(), "observation/state": np.zeros(3)}
    got = policy_input(obs, ())
    assert [c.name for c in got.cameras] == ["wrist_image", "image"] and got.body["prompt"] == ""


@pytest.mark.parametrize("obs, param", [
    ({"image": {"base_0_rgb": img()}, "state": [0.0]}, "left_wrist_0_rgb"),
    ({"image": {"base_0_rgb": img(), "right_wrist_0_rgb": img()}, "state": [0.0]}, "image/right_wrist_0_rgb"),
    ({"image": {"base_0_rgb": img()}, "observation/image": img(), "state": [0.0]}, "observation/image"),
    ({"images": {"base_0_rgb": img()}, "state": [0.0], "extra": 1}, "extra"),
    ({"images": {"base_0_rgb": img()}}, "observation/state"),
    ({"images": {"base_0_rgb": img()}, "state": [np.nan]}, "state"),
    ({"images": {"base_0_rgb": np.zeros((4, 5, 4), np.uint8)}, "state": [0.0]}, "images/base_0_rgb"),
    ({"images": {"base_0_rgb": img()}, "state": [0.0], "prompt": 3}, "prompt"),
])
def test_refusals(obs, param):
    with pytest.raises(ApiError) as info:
        policy_input(obs, SLOTS[:2])
    assert info.value.param == param and info.value.status == 400


def test_unpack_arrays_refuses_object_dtype():
    arr = np.arange(6, dtype="<f4").reshape(2, 3)
    packed = {b"__ndarray__": True, b"data": arr.tobytes(), b"dtype": "<f4", b"shape": [2, 3]}
    assert np.array_equal(unpack_arrays({"a": [packed]})["a"][0], arr)
    with pytest.raises(ApiError):
        unpack_arrays({b"__ndarray__": True, b"data": b"", b"dtype": "|O", b"shape": [0]})
