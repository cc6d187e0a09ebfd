"""llama.cpp's own HF -> GGUF converter (`convert_hf_to_gguf.py`, its `conversion` package and
the `gguf-py` beside it), from the llama.cpp sources that the `llama-cpp-python` sdist vendors:
either the peer build's unpacked sdist (`../shared/peers/install-llama-server`, in
$LLAMA_PEER_DIR or ~/.cache/mstar-peers/llama.cpp) or the three paths alone that
`scripts/fetch-llama-converter` extracts into ~/.cache/mstar-peers/converter. Nothing here
downloads: without either, `converter()` is None and the tests that need it skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

#: where `scripts/fetch-llama-converter` puts it (its default DIR)
CACHE_DIR = Path.home() / ".cache" / "mstar-peers" / "converter"


def _complete(script: Path) -> bool:
    """The converter script with its package and gguf-py beside it (a tree still being
    unpacked lacks some)."""
    root = script.parent
    return all(p.is_file() for p in (script, root / "conversion" / "__init__.py",
                                     root / "gguf-py" / "gguf" / "__init__.py"))


def converter() -> Path | None:
    """The path of llama.cpp's `convert_hf_to_gguf.py` (the peer's sources first, then the
    fetched copy), or None when neither is there whole."""
    peer = Path(os.environ.get("LLAMA_PEER_DIR") or Path.home() / ".cache" / "mstar-peers" / "llama.cpp")
    for script in (peer / "src" / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py",
                   CACHE_DIR / "llama.cpp" / "convert_hf_to_gguf.py"):
        if _complete(script):
            return script
    return None


def chat_template(name: str) -> str | None:
    """A chat template llama.cpp keeps of a model it serves (`models/templates/<name>`, e.g.
    gpt-oss's `openai-gpt-oss-120b.jinja`) from the same sources, or None when not there."""
    peer = Path(os.environ.get("LLAMA_PEER_DIR") or Path.home() / ".cache" / "mstar-peers" / "llama.cpp")
    for root in (peer / "src" / "vendor" / "llama.cpp", CACHE_DIR / "llama.cpp"):
        path = root / "models" / "templates" / name
        if path.is_file():
            return path.read_text()
    return None


def convert(ckpt: Path, out: Path, outtype: str = "f32", timeout: float = 300) -> Path:
    """Run the converter on the HF checkpoint folder `ckpt` in a subprocess of this Python
    (its own gguf-py first on the path), writing `out`; a RuntimeError with the end of its
    log when it fails."""
    script = converter()
    if script is None:
        raise RuntimeError("llama.cpp's converter is not available (scripts/fetch-llama-converter fetches it)")
    env = {**os.environ, "PYTHONPATH": str(script.parent / "gguf-py")}
    env.pop("NO_LOCAL_GGUF", None)
    proc = subprocess.run([sys.executable, str(script), str(ckpt), "--outtype", outtype, "--outfile", str(out)],
                          env=env, cwd=script.parent, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not Path(out).is_file():
        log = (proc.stdout + proc.stderr)[-3000:]
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {ckpt} (exit {proc.returncode}):\n{log}")
    return Path(out)


def smollm2_vocabulary(out: Path) -> Path:
    """The default model's BPE vocabulary (SmolLM2's, rebuilt from its GGUF file) as
    tokenizer.json and tokenizer_config.json in `out`: a vocabulary whose pre-tokenizer the
    converter names by its hash, for checkpoints it is to convert."""
    import json

    from shared.model_source import ModelSource

    bundle = ModelSource("").tokenizer
    out.mkdir(parents=True, exist_ok=True)
    bundle.tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GPT2Tokenizer", "bos_token": bundle.bos_token, "eos_token": bundle.eos_token,
        "unk_token": "<|endoftext|>", "chat_template": bundle.chat_template}))  # as SmolLM2's own says
    return out
