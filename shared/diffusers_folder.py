"""A diffusers pipeline folder (`model_index.json` and a folder per component) read as one
config, the way every service reads a checkpoint (`ModelSource.config`).

The pipeline's class (`_class_name`) is the architecture the spec registry looks up; each
component's config.json (or scheduler_config.json) sits under its folder's name, so a spec
reads `config["transformer"]`, `config["vae"]`, `config["scheduler"]` and the pipeline's own
settings under `config["pipeline"]`. Weights stay where diffusers saves them
(`<component>/diffusion_pytorch_model*.safetensors`): `component_weights` lists them with
the component's name, which prefixes each tensor's name (`transformer.layers.0...`).
"""

from __future__ import annotations

import json
from pathlib import Path

from shared.specs.base import DeploymentError

MODEL_INDEX = "model_index.json"
#: each component's config file, in the order diffusers writes them
_CONFIG_FILES = ("config.json", "scheduler_config.json")
#: the tokenizer's folder in the pipelines served here
TOKENIZER_FOLDERS = ("text_tokenizer", "tokenizer")


def is_diffusers_folder(path: Path) -> bool:
    return (path / MODEL_INDEX).is_file() and not (path / "config.json").exists()


def diffusers_config(path: Path) -> dict:
    """{"architectures": [the pipeline's class], "pipeline": model_index.json, <component>:
    its config} for every component folder with a config file."""
    index = json.loads((path / MODEL_INDEX).read_text())
    name = index.get("_class_name")
    if not isinstance(name, str):
        raise DeploymentError(f"{path / MODEL_INDEX} names no _class_name")
    config: dict = {"architectures": [name], "pipeline": index}
    for component, entry in index.items():
        if component.startswith("_") or not isinstance(entry, list) or entry[0] is None:
            continue
        for file in _CONFIG_FILES:
            if (path / component / file).is_file():
                config[component] = json.loads((path / component / file).read_text())
                break
    return config


def tokenizer_folder(path: Path) -> Path:
    """The component folder holding the pipeline's tokenizer.json."""
    for name in TOKENIZER_FOLDERS:
        if (path / name / "tokenizer.json").is_file():
            return path / name
    raise DeploymentError(f"diffusers folder {path} has no tokenizer.json under {list(TOKENIZER_FOLDERS)}")


def component_weights(path: Path, components: tuple[str, ...]) -> list[tuple[str, Path]]:
    """(component, file) of every safetensors file of `components`, in order."""
    out: list[tuple[str, Path]] = []
    for component in components:
        files = sorted((path / component).glob("*.safetensors"))
        if not files:
            raise DeploymentError(f"diffusers folder {path} has no {component}/*.safetensors")
        out.extend((component, f) for f in files)
    return out
