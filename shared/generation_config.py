"""A checkpoint's own sampling defaults: its `generation_config.json`, as vLLM's
`--generation-config auto` reads it.

The file's `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty` and
`max_new_tokens` apply to every route where the request leaves them out (a request's own
value always wins); `max_new_tokens` is the default `max_tokens`, still bounded by what the
prompt leaves of the sequence. `do_sample: false` written in the file means greedy, as
transformers' `generate` reads it (temperature 0). A GGUF file has no such file: the
engine's defaults stay (temperature 1, no top-p / top-k).

`--generation-config` (`MSTAR_GENERATION_CONFIG`): `auto` (the model folder's file, the
default), `vllm` or `none` (ignore it), or a folder (or the file itself) to read instead.
A value out of its range is refused when the api starts, naming the file and the key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

FILE = "generation_config.json"
#: the settings that leave the file's defaults out
OFF = ("vllm", "none")
#: `--generation-config`'s help, in `mstar serve` and the api's own flags
FLAG_HELP = (
    "the model's default sampling where a request leaves it out: auto (the checkpoint's generation_config.json: "
    "temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens as the default max_tokens), "
    "vllm or none (the engine's own defaults), or a folder holding a generation_config.json "
    "(env MSTAR_GENERATION_CONFIG; default auto)")


class GenerationDefaults(msgspec.Struct, frozen=True, omit_defaults=True):
    """The defaults in force (None: the engine's own)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    #: the default `max_tokens` (the file's `max_new_tokens`)
    max_tokens: int | None = None

    def sampling(self) -> dict[str, float | int]:
        """The sampling fields it sets, as `SamplingParams` names them."""
        return {name: value for name in SAMPLING if (value := getattr(self, name)) is not None}

    def describe(self) -> str:
        """One line for the start-up log and `/v1/models`."""
        fields = msgspec.structs.asdict(self)
        return ", ".join(f"{k}={v}" for k, v in fields.items() if v is not None) or "none"


SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _number(data: dict[str, Any], key: str, where: str, ok: Any, says: str, kind: type = float) -> Any:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and not isinstance(value, int)):
        raise ValueError(f"{where}: {key} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    if not ok(value):
        raise ValueError(f"{where}: {key} must be {says}, got {value!r}")
    return kind(value)


def parse_generation_config(data: dict[str, Any], where: str = FILE) -> GenerationDefaults:
    """The defaults a generation_config.json's object sets; ValueError naming `where` and
    the key for a value the engine could not honour."""
    top_k = _number(data, "top_k", where, lambda v: v >= -1, ">= -1 (0 or -1: off)", int)
    out = GenerationDefaults(
        temperature=_number(data, "temperature", where, lambda v: v >= 0, ">= 0"),
        top_p=_number(data, "top_p", where, lambda v: 0 < v <= 1, "in (0, 1]"),
        top_k=None if top_k is None else max(top_k, 0),
        min_p=_number(data, "min_p", where, lambda v: 0 <= v <= 1, "in [0, 1]"),
        repetition_penalty=_number(data, "repetition_penalty", where, lambda v: v > 0, "> 0"),
        max_tokens=_number(data, "max_new_tokens", where, lambda v: v >= 1, ">= 1", int),
    )
    if data.get("do_sample") is False:  # transformers' generate is greedy then, whatever temperature says
        out = msgspec.structs.replace(out, temperature=0.0, top_p=None, top_k=None, min_p=None)
    return out


def read_generation_defaults(setting: str, model_path: Path | None) -> GenerationDefaults:
    """The defaults `--generation-config` asks for: `auto` reads the model folder's file
    (none for a GGUF file or a folder without one), `vllm` / `none` none, anything else is
    a folder or file to read (which must exist)."""
    if setting in OFF:
        return GenerationDefaults()
    if setting == "auto":
        if model_path is None or not model_path.is_dir() or not (model_path / FILE).is_file():
            return GenerationDefaults()
        path = model_path / FILE
    else:
        path = Path(setting)
        if path.is_dir():
            path = path / FILE
        if not path.is_file():
            raise ValueError(f"--generation-config {setting}: no {FILE} there (auto, vllm, none, or a folder)")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable JSON file: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: must hold a JSON object")
    return parse_generation_config(data, str(path))
