"""A tiny random Qwen3-TTS CustomVoice checkpoint laid out as the Hub ships one
(Qwen/Qwen3-TTS-12Hz-*-CustomVoice: config.json, generation_config.json, vocab.json +
merges.txt + tokenizer_config.json and no tokenizer.json, model.safetensors, and the 12 Hz
codec in speech_tokenizer/), and the `qwen-tts` package's answers for it.

The reference pins transformers 4.57.3 (mstar's venv has 5.x), so it runs in a venv of its
own: `reference_python()` builds it once per pin set (tests/reference_venv.py: torch,
numpy, safetensors, soundfile come from mstar's venv; qwen-tts 0.1.1 is installed
--no-deps, its torchaudio / librosa / sox / onnxruntime stubbed by the script, and
transformers 4.57.3 with its own small deps shadows the 5.x). First build ~10-30 s (two
pip installs from PyPI), then nothing. tests/qwen3_tts_reference.py is what runs there;
its answers are kept beside the venv, keyed by every byte they depend on.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tests import reference_venv

PINS = ("qwen-tts==0.1.1", "transformers==4.57.3")
VENV = reference_venv.venv_path("qwen-tts-venv", PINS)
SCRIPT = Path(__file__).with_name("qwen3_tts_reference.py")
#: the package's answers, by `_answers_key`
ANSWERS = VENV.parent / "qwen-tts-answers"
#: the tiny checkpoints' weights, by the key `_weights` computes
WEIGHTS = VENV.parent / "qwen-tts-weights"

CODEBOOK = 64
GROUPS = 4
SPEAKERS = {"vivian": 80, "ryan": 81, "dylan": 82}
DIALECTS = {"vivian": False, "ryan": False, "dylan": "beijing_dialect"}
LANGUAGES = {"english": 90, "chinese": 91, "beijing_dialect": 92}
#: "assistant" and "user" one token each, as in Qwen's vocabulary (the reference slices the
#: prompt by position: `<|im_start|>assistant\n` is its first 3 ids)
MERGES = (*(("assistant"[:i], "assistant"[i]) for i in range(1, 9)), ("u", "s"), ("us", "e"), ("use", "r"),
          ("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "u"), ("Ġ", "w"))
#: the text vocabulary's specials, right after the bytes and merges (Qwen's are 151643...)
SPECIALS = {t: 256 + len(MERGES) + i for i, t in enumerate(
    ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|tts_pad|>", "<|tts_bos|>", "<|tts_eos|>"))}
TEXT_VOCAB = 300
#: a Base checkpoint's speaker encoder, shrunk (128 mels: the package's front end is fixed)
SPEAKER_ENCODER = {"mel_dim": 128, "enc_dim": 32, "enc_channels": [16, 16, 16, 16, 48],
                   "enc_kernel_sizes": [5, 3, 3, 3, 1], "enc_dilations": [1, 2, 3, 4, 1],
                   "enc_attention_channels": 8, "enc_res2net_scale": 4, "enc_se_channels": 8, "sample_rate": 24000}
#: the package's speaker encoder reads librosa's mel filters: real librosa for the reference,
#: installed beside its venv (--target) and put last on its path
LIBROSA_PIN = "librosa==0.11.0"
LIBROSA = VENV.parent / ("librosa-" + LIBROSA_PIN.split("==")[1])


def reference_python() -> Path:
    """The reference venv's python, built once when missing (tests/reference_venv.py): qwen-tts
    --no-deps, then transformers 4.57.3 with its deps and einops (the 25 Hz codec's import)."""
    return reference_venv.reference_python(VENV, [["--no-deps", PINS[0]], [PINS[1], "einops"]])


def librosa_path() -> Path:
    """LIBROSA, installed (once, under a lock) when missing: the reference's mel filters."""
    marker = LIBROSA / ".complete"
    if marker.is_file():
        return LIBROSA
    VENV.parent.mkdir(parents=True, exist_ok=True)
    with open(VENV.parent / (LIBROSA.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not marker.is_file():
            shutil.rmtree(LIBROSA, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--target",
                            str(LIBROSA), LIBROSA_PIN], check=True, capture_output=True)
            marker.touch()
    return LIBROSA



def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _tokenizer_files(folder: Path) -> None:
    """vocab.json + merges.txt (byte-level BPE: the 256 bytes, a few merges) and
    tokenizer_config.json with Qwen's specials as added tokens, as the Hub's repos ship them."""
    vocab = {ch: i for i, ch in enumerate(_bytes_to_unicode().values())}
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in MERGES))
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for t, i in SPECIALS.items()}
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "add_prefix_space": False, "added_tokens_decoder": added, "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "unk_token": None, "errors": "replace", "model_max_length": 32768,
        "clean_up_tokenization_spaces": False, "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer",
        "processor_class": "Qwen3TTSProcessor", "extra_special_tokens": {}}))


def _config(model_type: str = "custom_voice") -> dict:
    """The talker's config; a Base checkpoint ("base") has no speakers and a speaker encoder
    (ECAPA, shrunk: its x-vector is the talker's width)."""
    base = model_type == "base"
    talker = {
        "vocab_size": CODEBOOK + 1024, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "hidden_act": "silu",
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000,
        "rope_scaling": {"interleaved": True, "mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
        "attention_bias": False, "num_code_groups": GROUPS, "text_hidden_size": 24, "text_vocab_size": TEXT_VOCAB,
        "codec_eos_token_id": 72, "codec_think_id": 73, "codec_nothink_id": 74, "codec_think_bos_id": 75,
        "codec_think_eos_id": 76, "codec_pad_id": 70, "codec_bos_id": 71, "spk_id": {} if base else SPEAKERS,
        "spk_is_dialect": {} if base else DIALECTS, "codec_language_id": LANGUAGES, "position_id_per_seconds": 13,
        "code_predictor_config": {
            "vocab_size": CODEBOOK, "hidden_size": 24, "intermediate_size": 48, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "hidden_act": "silu",
            "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000, "num_code_groups": GROUPS,
            "attention_bias": False, "use_sliding_window": False}}
    return {"architectures": ["Qwen3TTSForConditionalGeneration"], "model_type": "qwen3_tts",
            "tokenizer_type": "qwen3_tts_tokenizer_12hz", "tts_model_size": "1b7", "tts_model_type": model_type,
            "im_start_token_id": SPECIALS["<|im_start|>"], "im_end_token_id": SPECIALS["<|im_end|>"],
            "tts_pad_token_id": SPECIALS["<|tts_pad|>"], "tts_bos_token_id": SPECIALS["<|tts_bos|>"],
            "tts_eos_token_id": SPECIALS["<|tts_eos|>"], "assistant_token_id": 0, "talker_config": talker,
            "speaker_encoder_config": SPEAKER_ENCODER if base else {"enc_dim": 32, "sample_rate": 24000},
            "torch_dtype": "float32", "transformers_version": "4.57.3"}


def _codec_config() -> dict:
    """The 12 Hz codec, shrunk: 4 codebooks of 64, 48 samples a frame (decoder: rates 4 x 3,
    ratios 2 x 2; encoder: Mimi's, strides 2, 3, 4 to 1000 Hz, then its downsample (stride 2)
    to 500 Hz as the real one's 25 -> 12.5 Hz, 8 quantizers of which the first 4 are kept)."""
    decoder = {"codebook_size": CODEBOOK, "hidden_size": 32, "latent_dim": 24, "codebook_dim": 16,
               "max_position_embeddings": 8000, "rope_theta": 10000, "num_attention_heads": 4,
               "num_key_value_heads": 4, "head_dim": 8, "attention_bias": False, "sliding_window": 8,
               "intermediate_size": 48, "hidden_act": "silu", "layer_scale_initial_scale": 0.01,
               "rms_norm_eps": 1e-5, "num_hidden_layers": 2, "num_quantizers": GROUPS, "upsample_rates": [4, 3],
               "upsampling_ratios": [2, 2], "decoder_dim": 32, "attention_dropout": 0.0}
    encoder = {"audio_channels": 1, "codebook_dim": 16, "codebook_size": CODEBOOK, "hidden_size": 16,
               "intermediate_size": 32, "num_filters": 4, "num_residual_layers": 1, "upsampling_ratios": [4, 3, 2],
               "kernel_size": 3, "last_kernel_size": 3, "residual_kernel_size": 3, "dilation_growth_rate": 2,
               "compress": 2, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
               "head_dim": 8, "sliding_window": 8, "num_quantizers": 2 * GROUPS, "num_semantic_quantizers": 1,
               "vector_quantization_hidden_dimension": 16, "upsample_groups": 16, "frame_rate": 500.0,
               "sampling_rate": 24000, "use_causal_conv": True, "pad_mode": "constant", "hidden_act": "gelu"}
    return {"architectures": ["Qwen3TTSTokenizerV2Model"], "model_type": "qwen3_tts_tokenizer_12hz",
            "encoder_valid_num_quantizers": GROUPS, "input_sample_rate": 24000, "output_sample_rate": 24000,
            "decode_upsample_rate": 48, "encode_downsample_rate": 48, "encoder_config": encoder,
            "decoder_config": decoder, "transformers_version": "4.57.3"}


def make_qwen3_tts_checkpoint(folder: Path, generation: dict | None = None, seed: int = 0,
                              model_type: str = "custom_voice") -> Path:
    """The tiny CustomVoice checkpoint in `folder` (3 speakers, one a dialect's), or a Base
    one (`model_type` "base": no speakers, a speaker encoder); its generation_config.json
    the Hub's, updated by `generation`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "speech_tokenizer").mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(_config(model_type), indent=1))
    gen = {"do_sample": True, "repetition_penalty": 1.05, "temperature": 0.9, "top_p": 1.0, "top_k": 50,
           "subtalker_dosample": True, "subtalker_temperature": 0.9, "subtalker_top_p": 1.0, "subtalker_top_k": 50,
           "max_new_tokens": 8192, **(generation or {})}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=1))
    (folder / "preprocessor_config.json").write_text(json.dumps({"processor_class": "Qwen3TTSProcessor"}))
    _tokenizer_files(folder)
    codec = folder / "speech_tokenizer"
    (codec / "config.json").write_text(json.dumps(_codec_config(), indent=1))
    (codec / "preprocessor_config.json").write_text(json.dumps({
        "feature_extractor_type": "EncodecFeatureExtractor", "feature_size": 1, "padding_side": "right",
        "padding_value": 0.0, "return_attention_mask": True, "sampling_rate": 24000}))
    _weights(folder, seed)
    return folder


def _weights(folder: Path, seed: int) -> None:
    """The package's random weights for the configs in `folder` (its own classes name every
    tensor), kept in WEIGHTS by a key of the configs, the seed, the pins and the script."""
    h = hashlib.sha256(json.dumps([PINS, seed]).encode() + SCRIPT.read_bytes())
    for name in ("config.json", "speech_tokenizer/config.json"):
        h.update((folder / name).read_bytes())
    kept = WEIGHTS / h.hexdigest()[:32]
    files = ("model.safetensors", "speech_tokenizer/model.safetensors")
    if not all((kept / f).is_file() for f in files):
        _run("weights", str(folder), str(seed))
        tmp = WEIGHTS / f".{kept.name}.{os.getpid()}"
        for f in files:
            (tmp / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(folder / f, tmp / f)
        shutil.rmtree(kept, ignore_errors=True)
        tmp.rename(kept)
        return
    for f in files:
        shutil.copyfile(kept / f, folder / f)


class _Gathered(Exception):
    """A reference run `qwen3_tts_prefetch` gathers instead of making (its arguments; the
    last names the file it writes)."""

    def __init__(self, args: tuple[str, ...], librosa: bool) -> None:
        super().__init__(args[0])
        self.args_, self.librosa = args, librosa


#: while `qwen3_tts_prefetch` gathers: the runs its calls need, with their cached names
_GATHERING: list[tuple[Path, _Gathered]] | None = None


def qwen3_tts_prefetch(*calls: Callable[[], object]) -> None:
    """Every reference run `calls` need and ANSWERS lacks, made in one process of the
    reference's venv (its imports cost ~10 s a process on a busy 2-core host): each call
    is made with its runs gathered, not made, then they run as one `jobs` command and their
    files are kept; a call made after finds its answers kept."""
    global _GATHERING
    _GATHERING = []
    try:
        for call in calls:
            try:
                call()
            except _Gathered:
                pass
        gathered, _GATHERING = _GATHERING, None
    finally:
        _GATHERING = None
    if not gathered:
        return
    jobs = ANSWERS.parent / f".qwen-tts-jobs.{os.getpid()}.json"
    jobs.write_text(json.dumps([list(g.args_) for _, g in gathered]))
    try:
        _run("jobs", str(jobs), librosa=any(g.librosa for _, g in gathered))
    finally:
        jobs.unlink(missing_ok=True)
    for cached, g in gathered:
        _keep(Path(g.args_[-1]), cached)


def _run(*args: str, timeout: float = 600, librosa: bool = False) -> None:
    if _GATHERING is not None and args[0] != "weights":
        raise _Gathered(args, librosa)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    env.pop("PYTHONPATH", None)
    env.pop("MSTAR_LIBROSA", None)
    if librosa:
        env["MSTAR_LIBROSA"] = str(librosa_path())
    proc = subprocess.run([str(reference_python()), str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=SCRIPT.parent)
    if proc.returncode != 0:
        raise RuntimeError(f"tests/qwen3_tts_reference.py {args[0]} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")


def _answers_key(folder: Path, cases: list[dict]) -> str:
    """What the package's answers depend on: the pins, the script, the cases and every
    byte of the checkpoint folder."""
    h = hashlib.sha256(json.dumps([PINS, cases]).encode() + SCRIPT.read_bytes())
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(folder)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:32]


def _answers(name: str, work: Path, make: Callable[[], Path]) -> Path:
    """ANSWERS / `name`, made once: `make` runs the reference in `work` and returns the file
    it wrote, copied in whole (a temporary name, then a rename: a concurrent test never
    reads half a file)."""
    cached = ANSWERS / name
    if not cached.is_file():
        work.mkdir(parents=True, exist_ok=True)
        try:
            made = make()
        except _Gathered as run:
            assert _GATHERING is not None
            _GATHERING.append((cached, run))
            raise
        _keep(made, cached)
    return cached


def _keep(made: Path, cached: Path) -> None:
    ANSWERS.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".{os.getpid()}.tmp")
    shutil.copyfile(made, tmp)
    tmp.replace(cached)


def _digest(waves: list[np.ndarray]) -> str:
    """The clips' content key (their float32 bytes)."""
    return hashlib.sha256(b"".join(w.astype(np.float32).tobytes() for w in waves)).hexdigest()


def qwen3_tts_reference(folder: Path, cases: list[dict], work: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """qwen-tts' greedy (codes [frames, groups], waveform) for each case {"text", "speaker",
    "instruct" (optional), "max_new_tokens"}. Kept in ANSWERS under a key of everything
    they depend on (`_answers_key`): the package's `generate` runs a nested `generate` per
    frame, ~0.5 s a frame on a busy 2-core host."""
    def make() -> Path:
        (work / "cases.json").write_text(json.dumps(cases))
        _run("generate", str(folder), str(work / "cases.json"), str(work / "out.npz"))
        return work / "out.npz"

    with np.load(_answers(f"{_answers_key(folder, cases)}.npz", work, make)) as out:
        return [(out[f"codes_{i}"], out[f"wave_{i}"]) for i in range(len(cases))]


def qwen3_tts_speaker_reference(folder: Path, waves: list[np.ndarray], work: Path
                                ) -> list[tuple[np.ndarray, np.ndarray]]:
    """The package's (log mel [frames, 128], x-vector [enc_dim]) of each 24 kHz clip: its
    `mel_spectrogram` with `extract_speaker_embedding`'s settings (librosa's real mel
    filters) and `extract_speaker_embedding` itself, on the Base checkpoint in `folder`.
    Kept in ANSWERS under a key of the checkpoint, the clips and librosa's pin."""
    def make() -> Path:
        np.savez(work / "waves.npz", **{f"wave_{i}": w.astype(np.float32) for i, w in enumerate(waves)})
        _run("speaker", str(folder), str(work / "waves.npz"), str(work / "speaker.npz"), librosa=True)
        return work / "speaker.npz"

    key = _answers_key(folder, [LIBROSA_PIN, _digest(waves)])
    with np.load(_answers(f"speaker-{key}.npz", work, make)) as out:
        return [(out[f"mel_{i}"], out[f"emb_{i}"]) for i in range(len(waves))]


def qwen3_tts_clone_reference(folder: Path, cases: list[dict], waves: list[np.ndarray], work: Path
                              ) -> list[tuple[np.ndarray, np.ndarray]]:
    """qwen-tts' greedy `generate_voice_clone(x_vector_only_mode=True, non_streaming_mode=True)`
    (codes [frames, groups], waveform) for each case {"text", "clip" (an index into `waves`,
    24 kHz), "max_new_tokens"} on the Base checkpoint in `folder`; kept in ANSWERS."""
    def make() -> Path:
        (work / "cases.json").write_text(json.dumps(cases))
        np.savez(work / "waves.npz", **{f"wave_{i}": w.astype(np.float32) for i, w in enumerate(waves)})
        _run("clone", str(folder), str(work / "cases.json"), str(work / "waves.npz"), str(work / "out.npz"),
             librosa=True)
        return work / "out.npz"

    key = _answers_key(folder, [*cases, LIBROSA_PIN, _digest(waves)])
    with np.load(_answers(f"clone-{key}.npz", work, make)) as out:
        return [(out[f"codes_{i}"], out[f"wave_{i}"]) for i in range(len(cases))]


def qwen3_tts_encode_reference(folder: Path, waves: list[np.ndarray], work: Path) -> list[np.ndarray]:
    """The 12 Hz codec's codes [frames, groups] of each 24 kHz clip, encoded alone by the
    package's `speech_tokenizer.encode` (the Base checkpoint's `ref_code`); kept in ANSWERS."""
    def make() -> Path:
        np.savez(work / "waves.npz", **{f"wave_{i}": w.astype(np.float32) for i, w in enumerate(waves)})
        _run("encode", str(folder), str(work / "waves.npz"), str(work / "codes.npz"))
        return work / "codes.npz"

    key = _answers_key(folder, [_digest(waves)])
    with np.load(_answers(f"encode-{key}.npz", work, make)) as out:
        return [out[f"codes_{i}"] for i in range(len(waves))]


def qwen3_tts_icl_reference(folder: Path, cases: list[dict], waves: list[np.ndarray], work: Path
                            ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """qwen-tts' greedy `generate_voice_clone(x_vector_only_mode=False, non_streaming_mode=True)`
    (ICL: the clip and its transcript) for each case {"text", "clip" (an index into `waves`),
    "ref_text", "max_new_tokens"} as one batch: (new codes [frames, groups], waveform, the
    clip's codes); kept in ANSWERS."""
    def make() -> Path:
        (work / "cases.json").write_text(json.dumps(cases))
        np.savez(work / "waves.npz", **{f"wave_{i}": w.astype(np.float32) for i, w in enumerate(waves)})
        _run("icl", str(folder), str(work / "cases.json"), str(work / "waves.npz"), str(work / "out.npz"),
             librosa=True)
        return work / "out.npz"

    key = _answers_key(folder, [*cases, LIBROSA_PIN, _digest(waves)])
    with np.load(_answers(f"icl-{key}.npz", work, make)) as out:
        return [(out[f"codes_{i}"], out[f"wave_{i}"], out[f"ref_{i}"]) for i in range(len(cases))]


def qwen3_tts_server(root: Path, log: Path):
    """A started server for a Qwen3-TTS test module: the tiny checkpoint at `root`, a pool
    small enough that the tests' batches share it, and the KV debug checks on."""
    from tests.servers import MstarServer

    return MstarServer(str(root), log, "--num-kv-pages", "64", "--page-size", "16", "--max-seq-len", "256",
                       "--max-batch-tokens", "24", env={"MSTAR_KV_DEBUG_ASSERTS": "1"}).start()
