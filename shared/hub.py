"""Model names the way `vllm serve` takes them: a local Hugging Face folder, a `.gguf`
file, or a Hugging Face Hub id (`org/name`) found in the local Hub cache.

Nothing is downloaded, ever (`local_files_only=True`, whatever HF_HUB_OFFLINE says): a
Hub id that is not in the cache is a one-line `DeploymentError` naming the cache folder
(`huggingface_hub.constants.HF_HUB_CACHE`, from HF_HOME / HF_HUB_CACHE) and the command
that puts it there. A local path that exists wins over a Hub id of the same spelling, as
in vLLM and transformers.
"""

from __future__ import annotations

from pathlib import Path

from shared.specs.base import DeploymentError


def is_hub_id(name: str) -> bool:
    """`org/name` (or a bare legacy `name`) that is not an existing local path."""
    if not name or Path(name).expanduser().exists() or name.endswith(".gguf"):
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def hub_cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def resolve_model(name: str) -> Path:
    """The local path `name` stands for: itself when it exists, else the cached snapshot
    folder of Hub id `name` (refs/main's commit). Raises DeploymentError otherwise."""
    local = Path(name).expanduser()
    if local.exists():
        return local
    if not is_hub_id(name):
        raise DeploymentError(f"model {name!r}: no such local folder or .gguf file "
                              "(and not a Hugging Face Hub id, org/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(name, local_files_only=True))
    except LocalEntryNotFoundError:
        raise DeploymentError(
            f"model {name!r} is not a local folder or .gguf file, and not in the Hugging Face cache {hub_cache()} "
            f"(mstar never downloads): get it there first with `huggingface-cli download {name}` "
            f"(`hf download {name}` with huggingface_hub >= 1.0), "
            "or set HF_HOME / HF_HUB_CACHE to the cache that has it"
        ) from None
