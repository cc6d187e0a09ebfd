"""An openpi observation dict (what openpi's and LeRobot's clients send `infer`) as the body
of `POST /v1/actions`: its cameras, state, prompt, and mstar's optional noise / seed.

openpi's own policies each read their robot's keys in an input transform (LiberoInputs,
DroidInputs, AlohaInputs) and put the cameras in the model's slots (`base_0_rgb`,
`left_wrist_0_rgb`, `right_wrist_0_rgb`); LeRobot names them `observation.images.<name>`.
The keys taken here (any mix of these layouts; anything else is refused naming the key):

- prompt: `prompt` (openpi), else `task` (LeRobot); a string, absent: "".
- state: `observation/state` (LIBERO), `state` (ALOHA), `observation.state` (LeRobot), else
  DROID's `observation/joint_position` followed by `observation/gripper_position`
  (DroidInputs' concatenation); a 1-D numeric array or list (a leading batch axis of 1 is
  dropped).
- cameras: every other `observation/<name>` key (LIBERO's `observation/image`,
  `observation/wrist_image`; DROID's `observation/exterior_image_1_left`, ...), each
  `observation.images.<name>` (LeRobot), and the entries of an `images` dict (ALOHA's
  `cam_high`, ...) or an `image` dict (openpi's model inputs: `base_0_rgb`, ...). An image
  is uint8 or float in [0, 1] (times 255, truncated, as openpi's `_parse_image`), HWC or
  CHW, 3 channels, an optional leading batch axis of 1.
- `noise` (chunk x max_action_dim) and `seed`: mstar's, as /v1/actions takes them (openpi's
  protocol has no noise; without them the server draws it).

A camera's name is the key's `<name>`. Where the model names its cameras (LeRobot's
`input_features`), a name it does not know is put in the slot openpi's transforms put it
in (LIBERO `image` -> `base_0_rgb`, `wrist_image` -> `left_wrist_0_rgb`; DROID
`exterior_image_1_left` -> `base_0_rgb`, `wrist_image_left` -> `left_wrist_0_rgb`; ALOHA
`cam_high` -> `base_0_rgb`, `cam_left_wrist` -> `left_wrist_0_rgb`, `cam_right_wrist` ->
`right_wrist_0_rgb`; ALOHA's `cam_low`, which AlohaInputs drops, is dropped) when the model
has that slot; a camera still unknown, one missing, or two in one slot is refused. A model
that names none takes the cameras in the order sent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from services.api.errors import invalid
from shared.deferred import deferred

if TYPE_CHECKING:
    import numpy as np
else:
    np = deferred("numpy")  # imported at first use (shared/deferred.py)

PROMPT_KEYS = ("prompt", "task")
STATE_KEYS = ("observation/state", "state", "observation.state")
DROID_STATE = ("observation/joint_position", "observation/gripper_position")
IMAGE_DICTS = ("images", "image")
OWN_KEYS = ("noise", "seed")
#: openpi's example cameras -> the model slot its input transform fills with them
ALIASES = {"image": "base_0_rgb", "wrist_image": "left_wrist_0_rgb", "exterior_image_1_left": "base_0_rgb",
           "wrist_image_left": "left_wrist_0_rgb", "cam_high": "base_0_rgb", "cam_left_wrist": "left_wrist_0_rgb",
           "cam_right_wrist": "right_wrist_0_rgb"}
#: openpi's example cameras its transforms do not feed the model
DROPPED = ("cam_low",)
TAKES = ("prompt | task; observation/state | state | observation.state (or DROID's observation/joint_position + "
         "observation/gripper_position); cameras as observation/<name>, observation.images.<name>, or an images "
         "/ image dict; optional noise, seed")


class Camera(NamedTuple):
    """One camera of the observation: its key (for errors), the model's name, its pixels."""

    key: str
    name: str
    pixels: np.ndarray


class PolicyInput(NamedTuple):
    """The observation as /v1/actions takes it (`body`, its images left out) and its cameras."""

    body: dict[str, Any]
    cameras: list[Camera]


def unpack_arrays(obj: Any) -> Any:
    """msgpack-numpy's arrays (`{b"__ndarray__": True, b"data", b"dtype", b"shape"}`, and
    `__npgeneric__` scalars) as numpy, all through `obj`; a 400 for a malformed or
    non-numeric one (object arrays could carry code in other decoders: never built here)."""
    if isinstance(obj, list):
        return [unpack_arrays(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if b"__ndarray__" in obj or b"__npgeneric__" in obj:
        try:
            dtype = np.dtype(obj[b"dtype"])
            if dtype.kind not in "biuf":
                raise ValueError(f"dtype {dtype} is not numeric")
            if b"__npgeneric__" in obj:
                return dtype.type(obj[b"data"])
            return np.frombuffer(obj[b"data"], dtype=dtype).reshape(obj[b"shape"])
        except (KeyError, TypeError, ValueError) as exc:
            raise invalid("observation", f"a msgpack-numpy array could not be read ({exc})") from exc
    return {k: unpack_arrays(v) for k, v in obj.items()}


def policy_input(obs: Any, cameras: tuple[str, ...]) -> PolicyInput:
    """The observation's prompt, state, noise, seed and cameras (the model's `cameras`
    names, or any where it names none); a 400 naming the openpi key otherwise."""
    if not isinstance(obs, dict) or not all(isinstance(k, str) for k in obs):
        raise invalid("observation", "the observation must be a map of string keys (openpi's infer(obs))")
    used: set[str] = set()
    body: dict[str, Any] = {"prompt": _prompt(obs, used)}
    state = _state(obs, used)
    for key in OWN_KEYS:
        if key in obs:
            used.add(key)
            body[key] = _plain(obs[key])
    found = _cameras(obs, used)
    unknown = [k for k in obs if k not in used]
    if unknown:
        raise invalid(unknown[0], f"unknown observation key {unknown[0]!r}; this endpoint takes {TAKES}")
    if not found:
        raise invalid("observation", f"the observation holds no camera; this endpoint takes {TAKES}")
    placed = _place(found, cameras)
    body["observation"] = {"images": {c.name: "-" for c in placed}, "state": state}
    return PolicyInput(body, placed)


def _prompt(obs: dict[str, Any], used: set[str]) -> str:
    for key in PROMPT_KEYS:
        if key in obs:
            used.add(key)
            value = obs[key]
            if isinstance(value, np.ndarray) and value.size == 1 and value.dtype.kind in "US":
                value = value.item()
            if isinstance(value, list) and len(value) == 1:  # a batch of one task (LeRobot)
                value = value[0]
            if isinstance(value, bytes):
                value = value.decode("utf-8", "replace")
            if not isinstance(value, str):
                raise invalid(key, f"{key} must be a string, got {type(value).__name__}")
            return value
    return ""


def _state(obs: dict[str, Any], used: set[str]) -> list[float]:
    for key in STATE_KEYS:
        if key in obs:
            used.add(key)
            return _vector(obs[key], key)
    if all(key in obs for key in DROID_STATE):
        used.update(DROID_STATE)
        return [v for key in DROID_STATE for v in _vector(obs[key], key)]
    raise invalid("observation/state", f"the observation holds no state; this endpoint takes {TAKES}")


def _vector(value: Any, key: str) -> list[float]:
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise invalid(key, f"{key} must be numbers ({exc})") from exc
    if arr.ndim == 2 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim == 0:
        arr = arr.reshape(1)  # DROID's gripper position may come as a scalar
    if arr.ndim != 1 or not np.isfinite(arr).all():
        raise invalid(key, f"{key} must be a 1-D array of finite numbers, got shape {list(arr.shape)}")
    return [float(v) for v in arr]


def _plain(value: Any) -> Any:
    """numpy as what the JSON body would hold (the noise as rows of floats; exact for float32)."""
    if isinstance(value, np.ndarray):
        return value.astype(np.float64).tolist() if value.dtype.kind == "f" else value.tolist()
    return value.item() if isinstance(value, np.generic) else value


def _cameras(obs: dict[str, Any], used: set[str]) -> list[Camera]:
    found: list[Camera] = []
    for key, value in obs.items():
        if key in used:
            continue
        if key in IMAGE_DICTS and isinstance(value, dict):
            used.add(key)
            for name, image in value.items():
                found.append(Camera(f"{key}/{name}", str(name), _pixels(image, f"{key}/{name}")))
        elif key.startswith("observation.images."):
            used.add(key)
            found.append(Camera(key, key.removeprefix("observation.images."), _pixels(value, key)))
        elif key.startswith("observation/") and key not in DROID_STATE:
            used.add(key)
            found.append(Camera(key, key.removeprefix("observation/"), _pixels(value, key)))
    return found


def _pixels(value: Any, key: str) -> np.ndarray:
    """HWC uint8, as openpi's `_parse_image` makes it (float * 255 truncated; CHW moved)."""
    if not isinstance(value, np.ndarray):
        raise invalid(key, f"{key} must be an image array (uint8 or float, HWC or CHW), got {type(value).__name__}")
    image = value[0] if value.ndim == 4 and value.shape[0] == 1 else value
    if image.dtype.kind == "f":
        image = (255 * image).astype(np.uint8)
    if image.ndim == 3 and image.shape[0] == 3 and image.shape[-1] != 3:
        image = image.transpose(1, 2, 0)
    if image.ndim != 3 or image.shape[-1] != 3 or image.dtype != np.uint8 or 0 in image.shape:
        raise invalid(key, f"{key} must be an RGB image (H x W x 3 or 3 x H x W, uint8 or float in [0, 1]), got "
                           f"{value.dtype} of shape {list(value.shape)}")
    return np.ascontiguousarray(image)


def _place(found: list[Camera], cameras: tuple[str, ...]) -> list[Camera]:
    """The cameras under the model's names, in its order (in the order sent where it names none)."""
    if not cameras:
        names = [c.name for c in found]
        for cam in found:
            if names.count(cam.name) > 1:
                raise invalid(cam.key, f"two cameras are named {cam.name!r}")
        return found
    slots: dict[str, Camera] = {}
    for cam in found:
        name = cam.name if cam.name in cameras else ALIASES.get(cam.name, "")
        if name not in cameras:
            if cam.name in DROPPED:
                continue
            raise invalid(cam.key, f"camera {cam.name!r} is not one of the model's {list(cameras)} (nor an "
                                   "openpi example camera that fills one)")
        if name in slots:
            raise invalid(cam.key, f"cameras {slots[name].key!r} and {cam.key!r} both fill the model's {name!r}")
        slots[name] = cam._replace(name=name)
    missing = [name for name in cameras if name not in slots]
    if missing:
        raise invalid(missing[0], f"the model needs camera {missing[0]!r} (its cameras: {list(cameras)}); the "
                                  f"observation has {[c.key for c in found]}")
    return [slots[name] for name in cameras]
