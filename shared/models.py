"""Several models behind one deployment (llama-server's router mode): which models, by
which names, and how many may be loaded at once.

`mstar serve --models-dir DIR` serves each subfolder (a Hugging Face folder) and each
.gguf file of DIR as a model named by its folder or file name (a .gguf's stem); repeated
`--model` adds models by path. The launcher hands the list to the conductor and the api
as one JSON value (`--models` / `MSTAR_MODELS`), with the addresses each model's data
worker and api socket use; the conductor keeps workers per model, the api routes each
request by its `model` field. With one model nothing of this is used: the services run
as they always did.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import msgspec

MODELS_ENV = "MSTAR_MODELS"
MODELS_MAX_ENV = "MSTAR_MODELS_MAX"


class ServedModel(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One model of a multi-model deployment: the name requests give as `model`, what
    `--model` would name (a folder, a .gguf file, a Hub id), and (filled by the launcher)
    the addresses of its data worker and of the api socket its outputs come back to."""

    name: str
    model: str
    data_worker_addr: str = ""
    api_addr: str = ""


def models_in_dir(folder: str) -> list[ServedModel]:
    """Every model of `folder`, in name order: each subfolder holding a config.json, each
    .gguf file; hidden entries and anything else are skipped. A folder with none is a
    ValueError (a typo should not start a server that serves nothing)."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise ValueError(f"--models-dir {folder}: not a folder")
    found = []
    for entry in sorted(root.iterdir()):
        if entry.name.startswith("."):
            continue
        if entry.is_dir() and (entry / "config.json").is_file():
            found.append(ServedModel(entry.name, str(entry.resolve())))
        elif entry.is_file() and entry.suffix == ".gguf":
            found.append(ServedModel(entry.stem, str(entry.resolve())))
    if not found:
        raise ValueError(f"--models-dir {folder}: no model in it (a subfolder with a config.json, or a .gguf file)")
    return found


def check_names(models: list[ServedModel]) -> None:
    """Names must be unique and non-empty: they are what a request's `model` selects."""
    seen: set[str] = set()
    for m in models:
        if not m.name.strip():
            raise ValueError(f"model {m.model!r} has an empty name")
        if m.name in seen:
            raise ValueError(f"two models are named {m.name!r}; each needs its own name")
        seen.add(m.name)


def encode_models(models: list[ServedModel]) -> str:
    return msgspec.json.encode(models).decode()


def decode_models(text: str) -> list[ServedModel]:
    try:
        models = msgspec.json.decode(text, type=list[ServedModel])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"--models / {MODELS_ENV} is not a JSON list of models: {exc}") from None
    check_names(models)
    return models


def add_models_flags(parser: argparse.ArgumentParser, models_max: bool = False) -> None:
    """`--models JSON` (as the launcher hands it; empty: one model, the deployment's), and
    for the conductor `--models-max`."""
    parser.add_argument("--models", default=os.environ.get(MODELS_ENV) or None, metavar="JSON",
                        help="several models behind one deployment: a JSON list of {name, model, data_worker_addr, "
                             f"api_addr}} as `mstar serve` hands it (env {MODELS_ENV}; default: none, the one "
                             "model of --model)")
    if models_max:  # meaningful where a supervisor (`mstar serve`) starts and stops the workers by it
        parser.add_argument("--models-max", type=int, default=int(os.environ.get(MODELS_MAX_ENV) or 0),
                            help="most models wanted loaded at once, as `mstar serve --models-max` hands it (its "
                                 "launcher, or another supervisor, starts and stops each model's gpu workers by "
                                 "GET /models' `wanted`: docs/deploy.md) "
                                 f"(env {MODELS_MAX_ENV}; default 0: every model)")


def models_from_args(args: argparse.Namespace) -> list[ServedModel]:
    return decode_models(args.models) if getattr(args, "models", None) else []
