"""A tiny random Chatterbox checkpoint laid out as the Hub ships ResembleAI/chatterbox
(t3_cfg.safetensors, s3gen.safetensors, ve.safetensors, tokenizer.json, conds.pt), and the
`chatterbox-tts` package's answers for it.

The package hard-codes its sizes (T3's Llama_520M, the Perceiver, S3Gen's constructors,
S3TokenizerV2's ModelConfig), so the checkpoint adds a config.json the Hub's has not: the
shrunk sizes, by section ("t3", "s3gen", "s3tokenizer"). tests/chatterbox_reference.py
patches the package's constants from it; mstar reads the same file (absent: the package's
sizes).

The reference pins torch 2.6 / transformers 5.2 / gradio and more, so it runs in a venv of its
own: `reference_python()` builds it once per pin set (tests/reference_venv.py: torch,
transformers, diffusers, einops, safetensors, tokenizers come from mstar's venv; chatterbox-tts,
conformer and s3tokenizer are installed --no-deps). First build ~5-10 s (three small wheels
from PyPI), then nothing. tests/chatterbox_reference.py is what runs there.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np

from tests import reference_venv
from tests.qwen3_tts_checkpoints import librosa_path

#: a clip case's conditionals in the reference's answers
CLIP_KEYS = ("speaker_emb", "t3_tokens", "prompt_token", "prompt_feat", "xvector")
PINS = ("chatterbox-tts==0.1.7", "conformer==0.3.2", "s3tokenizer==0.3.0")
VENV = reference_venv.venv_path("chatterbox-venv", PINS)
SCRIPT = Path(__file__).with_name("chatterbox_reference.py")

#: the package's special text tokens (tokenizers/tokenizer.py) at the ids its T3Config uses
SPECIALS = {"[STOP]": 0, "[UNK]": 1, "[SPACE]": 2, "[PAD]": 3, "[SEP]": 4, "[CLS]": 5, "[MASK]": 6,
            "[START]": 255}
MERGES = (("t", "h"), ("th", "e"), ("i", "n"), ("e", "r"), ("o", "u"), ("a", "n"))

TINY = {
    "t3": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16,
           "perceiver": {"pre_attention_query_token": 32, "pre_attention_query_size": 64, "embedding_dim": 64,
                         "num_attn_heads": 4}},
    "s3gen": {"UpsampleConformerEncoder": {"num_blocks": 1, "linear_units": 64, "attention_heads": 2},
              "ConditionalDecoder": {"channels": [32], "n_blocks": 1, "num_mid_blocks": 1, "num_heads": 2,
                                     "attention_head_dim": 16},
              "HiFTGenerator": {"base_channels": 32},
              "ConvRNNF0Predictor": {"cond_channels": 32},
              "CAMPPlus": {"init_channels": 16, "growth_rate": 8}},
    # its rotary tables are 64 wide: one head of 64
    "s3tokenizer": {"n_audio_state": 64, "n_audio_head": 1, "n_audio_layer": 1},
}


def reference_python() -> Path:
    """The reference venv's python, built once when missing (tests/reference_venv.py)."""
    return reference_venv.reference_python(VENV, [["--no-deps", *PINS]])


def _tokenizer_json() -> dict:
    """A BPE tokenizer.json as the package's EnTokenizer reads it: characters and a few
    merges, the specials as added tokens ("[SPACE]" stands for a space: the package replaces
    spaces before encoding)."""
    chars = [chr(c) for c in range(33, 127) if chr(c) not in "[]"]
    vocab = dict(SPECIALS)
    free = iter(i for i in range(len(SPECIALS), 704) if i not in SPECIALS.values())
    for piece in chars + [a + b for a, b in MERGES]:
        vocab[piece] = next(free)
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for t, i in SPECIALS.items()]
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
            "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
            "model": {"type": "BPE", "dropout": None, "unk_token": "[UNK]", "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "vocab": vocab, "merges": [f"{a} {b}" for a, b in MERGES]}}


def chatterbox_configs(folder: Path) -> Path:
    """The tiny checkpoint's config.json and tokenizer.json in `folder`; its weights come
    with the first `chatterbox_reference` (or `make_chatterbox_checkpoint`)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY, indent=1))
    (folder / "tokenizer.json").write_text(json.dumps(_tokenizer_json()))
    return folder


def make_chatterbox_checkpoint(folder: Path, seed: int = 0) -> Path:
    """The tiny checkpoint in `folder` (made once: a folder holding conds.pt is reused)."""
    if (folder / "conds.pt").is_file():
        return folder
    chatterbox_configs(folder)
    _run("weights", str(folder), str(seed))
    return folder


def _run(*args: str, timeout: float = 600, librosa: bool = False) -> None:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
           "TQDM_DISABLE": "1"}
    env.pop("PYTHONPATH", None)
    env.pop("MSTAR_LIBROSA", None)
    if librosa:  # a reference clip's path: the real librosa (tests/chatterbox_reference.py)
        env["MSTAR_LIBROSA"] = str(librosa_path())
    proc = subprocess.run([str(reference_python()), str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=SCRIPT.parent)
    if proc.returncode != 0:
        raise RuntimeError(f"tests/chatterbox_reference.py {args[0]} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")


def chatterbox_reference(folder: Path, cases: list[dict], work: Path, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """The package's answers for each case (see tests/chatterbox_reference.py): "tokens" (T3's
    speech tokens), "s3_tokens" (what S3Gen decoded), "logits" (the first step's [cond,
    uncond]) and "wave" (24 kHz float32). A folder of `chatterbox_configs` only gets its
    weights (from `seed`) in the same run."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "cases.json").write_text(json.dumps(cases))
    _run("generate", str(folder), str(work / "cases.json"), str(work / "out.npz"), str(seed),
         librosa=any("clip" in c for c in cases))
    with np.load(work / "out.npz") as out:
        return [{k: out[f"{k}_{i}"] for k in ("tokens", "s3_tokens", "logits", "wave", "mel", "rng", "hift", "flow_rng",
                                              *CLIP_KEYS) if f"{k}_{i}" in out} for i in range(len(cases))]


def speech_clip(seconds: float, seed: int, rate: int = 24000) -> np.ndarray:
    """A speech-like reference clip: a gliding harmonic tone under a syllable envelope,
    with a little noise and a quiet lead-in (the voice encoder trims silence)."""
    gen = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    f0 = 110 + 40 * (seed % 3) + 30 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    voice = sum(np.sin(k * phase) / k for k in range(1, 6))
    envelope = np.clip(np.sin(2 * np.pi * 3.1 * t), 0, None) * (t > 0.2)
    return (0.3 * voice * envelope + 0.01 * gen.standard_normal(t.size)).astype(np.float32)


def wav_bytes(samples: np.ndarray, rate: int = 24000) -> bytes:
    """16-bit PCM WAV of `samples` (what a client sends as a clip)."""
    import io

    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()
