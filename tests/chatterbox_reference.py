"""The `chatterbox-tts` package's side of the Chatterbox tests, run as a script in the
reference's own venv (tests/chatterbox_checkpoints.py builds it: the package pins torch 2.6,
transformers 5.2 and more; installed --no-deps, it runs on this venv's torch and transformers).

    python chatterbox_reference.py weights FOLDER SEED
        random weights for the tiny checkpoint whose sizes FOLDER/config.json holds, from the
        package's own classes (so every parameter name is theirs): t3_cfg.safetensors,
        s3gen.safetensors, ve.safetensors, and the built-in voice conds.pt
    python chatterbox_reference.py generate FOLDER CASES.json OUT.npz [SEED]
        `ChatterboxTTS.from_local(FOLDER).generate` for each case {"text", "seed", "max_new_tokens",
        "temperature", "cfg_weight", "exaggeration", "repetition_penalty", "min_p", "top_p", "clip"}:
        T3's speech tokens (`tokens_i`, EOS included when it stopped), the conditional and
        unconditional logits of its first step (`logits_i` [2, vocab], for distribution checks)
        and the waveform (`wave_i`, 24 kHz float32), with the vocoder's input mel, the global
        RNG state before it and its output (`mel_i`, `rng_i`, `hift_i`); T3 runs `max_new_tokens` steps at most (the
        package's generate passes 1000: a random T3 seldom says EOS); the global RNG is seeded with the case's
        seed before T3 (S3Gen's flow-matching noise and HiFT's source continue it, as in the package);
        a case with "wave": false skips S3Gen (an empty `wave_i`); a case with "clip" (a WAV
        path) is `generate(audio_prompt_path=clip)`, its conditionals kept (`speaker_emb_i`,
        `t3_tokens_i`, `prompt_token_i`, `prompt_feat_i`, `xvector_i`). With SEED, a folder
        without weights gets them first (`weights`), in the same process: the package's
        imports cost seconds

The package's sizes are hard-coded (T3's `LLAMA_CONFIGS["Llama_520M"]`, the Perceiver's
defaults, S3Gen's constructor arguments, S3TokenizerV2's default ModelConfig): `shrink`
patches them from config.json's "t3" / "s3gen" / "s3tokenizer" sections, as mstar reads them.

Stubbed before the package is imported: torchaudio (no wheel loads against this torch): its
`transforms.Resample` and `compliance.kaldi.fbank`, which a reference clip's path runs, are
transcribed (`_resample`, `_fbank`); librosa is the real one where MSTAR_LIBROSA names its
folder (a clip's cases: mel filters, stft, effects.trim), except `resample`, which is
torchaudio's kernel there too (the package's librosa default, soxr, is a C library mstar does
not port: mstar resamples a clip with torchaudio's kernel wherever the package resamples);
without it a stub (`filters.mel` returns zeros of its shape: the default voice never reads them),
onnx (s3tokenizer's weight converter), omegaconf (a type the flow's defaults name), perth
(the watermarker: `apply_watermark` returns the waveform unchanged, so the reference's wave is
S3Gen's own).
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path


def _stub(name: str, **attrs) -> types.ModuleType:
    import importlib.machinery

    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


def _stub_packages() -> None:
    import os

    import numpy as np

    def unused(*_a, **_k):
        raise RuntimeError("stubbed in tests/chatterbox_reference.py")

    def mel(*, sr=16000, n_fft=400, n_mels=128, **_k):
        return np.zeros((n_mels, n_fft // 2 + 1), dtype=np.float32)

    if os.environ.get("MSTAR_LIBROSA"):  # the real one (mel filters, stft, trim); resampling below
        sys.path.append(os.environ["MSTAR_LIBROSA"])
        import librosa
        import librosa.effects
        import librosa.filters

        def resample(y, *, orig_sr, target_sr, **_k):
            import torch
            return _resample(torch.from_numpy(np.asarray(y, dtype=np.float32)), orig_sr, target_sr).numpy()
        librosa.resample = resample
    else:
        librosa = _stub("librosa", load=unused, resample=unused)
        librosa.filters = _stub("librosa.filters", mel=mel)  # type: ignore[attr-defined]
        librosa.util = _stub("librosa.util", normalize=unused)  # type: ignore[attr-defined]
    torchaudio = _stub("torchaudio", load=unused)
    torchaudio.transforms = _stub("torchaudio.transforms", Resample=_Resample)  # type: ignore[attr-defined]
    compliance = _stub("torchaudio.compliance")
    torchaudio.compliance = compliance  # type: ignore[attr-defined]
    compliance.kaldi = _stub("torchaudio.compliance.kaldi", fbank=_fbank)  # type: ignore[attr-defined]
    _stub("onnx", load=unused)
    _stub("omegaconf", DictConfig=dict)

    class Watermarker:
        def apply_watermark(self, wav, sample_rate=None):
            return wav

    _stub("perth", PerthImplicitWatermarker=Watermarker)


def _resample(wave, orig: int, new: int, zeros: int = 6, rolloff: float = 0.99):
    """torchaudio's `functional.resample` (windowed sinc, Hann window, its defaults) of
    [..., n]: a polyphase filter bank of `new` phases over the rate pair reduced by their
    gcd, applied as a strided convolution over the zero-padded signal."""
    import math

    import torch
    import torch.nn.functional as F

    g = math.gcd(int(orig), int(new))
    orig, new = int(orig) // g, int(new) // g
    if orig == new:
        return wave
    cutoff = min(orig, new) * rolloff
    width = math.ceil(zeros * orig / cutoff)
    taps = torch.arange(-width, width + orig, dtype=wave.dtype)[None, None] / orig
    t = (torch.arange(0, -new, -1, dtype=wave.dtype)[:, None, None] / new + taps) * cutoff
    t = t.clamp(-zeros, zeros)
    window = torch.cos(t * math.pi / zeros / 2) ** 2
    t = t * math.pi
    kernel = torch.where(t == 0, torch.ones_like(t), torch.sin(t) / t) * window * (cutoff / orig)
    flat = wave.reshape(-1, wave.shape[-1])
    out = F.conv1d(F.pad(flat, (width, width + orig))[:, None], kernel, stride=orig)
    out = out.transpose(1, 2).reshape(flat.shape[0], -1)[:, : math.ceil(new * flat.shape[-1] / orig)]
    return out.reshape(*wave.shape[:-1], out.shape[-1])


class _Resample:
    """torchaudio's `transforms.Resample(orig, new)` (its default kernel)."""

    def __init__(self, orig: int, new: int) -> None:
        self.orig, self.new = orig, new

    def to(self, _device):
        return self

    def __call__(self, wave):
        return _resample(wave, self.orig, self.new)


def _fbank(wave, num_mel_bins: int = 23, sample_frequency: float = 16000.0, frame_length: float = 25.0,
           frame_shift: float = 10.0, low_freq: float = 20.0, high_freq: float = 0.0, preemphasis: float = 0.97):
    """torchaudio's `compliance.kaldi.fbank` at its defaults otherwise (Kaldi's
    compute-fbank-feats): no dither, snip edges, each frame's DC removed, pre-emphasis (the
    first sample against itself), Povey window, zero-padded to a power of two, power
    spectrum, Kaldi's mel triangles (1127 ln(1 + f/700)), log of max(., float eps)."""
    import math

    import torch

    x = wave[0]
    size, shift = int(sample_frequency * frame_length / 1000), int(sample_frequency * frame_shift / 1000)
    padded = 1 << (size - 1).bit_length()
    count = 1 + (x.shape[0] - size) // shift
    frames = torch.stack([x[i * shift: i * shift + size] for i in range(count)])
    frames = frames - frames.mean(dim=1, keepdim=True)
    previous = torch.cat([frames[:, :1], frames[:, :-1]], dim=1)
    frames = frames - preemphasis * previous
    frames = frames * torch.hann_window(size, periodic=False, dtype=x.dtype).pow(0.85)
    frames = torch.nn.functional.pad(frames, (0, padded - size))
    power = torch.fft.rfft(frames).abs().pow(2.0)
    nyquist = sample_frequency / 2
    high = high_freq + nyquist if high_freq <= 0 else high_freq

    def mel(f):
        return 1127.0 * math.log(1.0 + f / 700.0)

    lo, hi = mel(low_freq), mel(high)
    step = (hi - lo) / (num_mel_bins + 1)
    b = torch.arange(num_mel_bins).unsqueeze(1)
    left, center, right = lo + b * step, lo + (b + 1.0) * step, lo + (b + 2.0) * step
    fft_mel = 1127.0 * (1.0 + (sample_frequency / padded) * torch.arange(padded // 2) / 700.0).log()
    up, down = (fft_mel - left) / (center - left), (right - fft_mel) / (right - center)
    banks = torch.max(torch.zeros(1), torch.min(up, down)).to(x.dtype)
    banks = torch.nn.functional.pad(banks, (0, 1))
    eps = torch.tensor(torch.finfo(torch.float).eps, dtype=x.dtype)
    return torch.max(power @ banks.T, eps).log()


def shrink(folder: Path) -> None:
    """The package's hard-coded sizes, patched from FOLDER/config.json (absent: the package's)."""
    import functools

    path = folder / "config.json"
    cfg = json.loads(path.read_text()) if path.is_file() else {}
    from chatterbox.models.s3gen import s3gen
    from chatterbox.models.t3 import llama_configs
    from chatterbox.models.t3.modules import cond_enc, perceiver
    from s3tokenizer import model_v2

    t3 = dict(cfg.get("t3") or {})
    perc = t3.pop("perceiver", None)
    llama_configs.LLAMA_CONFIGS["Llama_520M"].update(t3)
    if perc:
        cond_enc.Perceiver = functools.partial(perceiver.Perceiver, **perc)
    sg = cfg.get("s3gen") or {}
    for name, kwargs in sg.items():  # e.g. "ConditionalDecoder": {...}, "HiFTGenerator": {...}
        setattr(s3gen, name, _with_kwargs(getattr(s3gen, name), kwargs))
    default = model_v2.S3TokenizerV2.__init__.__defaults__[0]
    for k, v in (cfg.get("s3tokenizer") or {}).items():
        setattr(default, k, v)


def _with_kwargs(cls, kwargs: dict):
    def make(*args, **kw):
        return cls(*args, **{**kw, **kwargs})
    return make


def _randomize(model, seed: int, std: float = 0.2) -> None:
    """Every parameter drawn afresh (norms near 1), so no code path is flat."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            if p.ndim == 1 and ("norm" in name or name.endswith((".weight", ".gamma"))) and "bias" not in name:
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(std * noise)


def weights(folder: Path, seed: int) -> None:
    import torch
    from chatterbox.models.s3gen import S3Gen
    from chatterbox.models.t3 import T3
    from chatterbox.models.t3.modules.cond_enc import T3Cond
    from chatterbox.models.voice_encoder import VoiceEncoder
    from chatterbox.tts import Conditionals
    from safetensors.torch import save_file

    torch.manual_seed(seed)

    def save(model, name: str, s: int) -> None:
        _randomize(model, s)
        state = {k: v.contiguous() for k, v in model.state_dict().items()
                 if not k.startswith("tokenizer.") or k.split(".", 1)[1] not in ("_mel_filters", "window")}
        save_file(state, str(folder / name))
    save(T3(), "t3_cfg.safetensors", seed)
    s3 = S3Gen()
    save(s3, "s3gen.safetensors", seed + 1)
    save(VoiceEncoder(), "ve.safetensors", seed + 2)
    gen = torch.Generator().manual_seed(seed + 3)
    prompt_len = 8
    t3 = T3Cond(speaker_emb=torch.randn(1, 256, generator=gen),
                cond_prompt_speech_tokens=torch.randint(0, 6561, (1, 150), generator=gen),
                emotion_adv=0.5 * torch.ones(1, 1, 1))
    ref = dict(prompt_token=torch.randint(0, 6561, (1, prompt_len), generator=gen),
               prompt_token_len=torch.tensor([prompt_len]),
               prompt_feat=torch.randn(1, 2 * prompt_len, 80, generator=gen),
               prompt_feat_len=None,
               embedding=torch.randn(1, 192, generator=gen))
    Conditionals(t3, ref).save(folder / "conds.pt")


def generate(folder: Path, cases_path: Path, out: Path) -> None:
    import numpy as np
    import torch
    from chatterbox.tts import ChatterboxTTS

    model = ChatterboxTTS.from_local(folder, "cpu")
    seen: dict = {}
    t3_inference, s3_inference = model.t3.inference, model.s3gen.inference

    def t3_run(**kw):
        kw["max_new_tokens"] = seen["max_new_tokens"]  # the package's generate says 1000
        seen["tokens"] = t3_inference(**kw)
        return seen["tokens"]

    def s3_run(**kw):
        seen["s3_tokens"] = kw["speech_tokens"]
        if not seen["wave"]:
            return torch.zeros(1, 0), None
        seen["flow_rng"] = torch.get_rng_state().numpy()
        return s3_inference(**kw)

    hift_inference = model.s3gen.hift_inference

    def hift_run(speech_feat, cache_source=None):
        seen["mel"], seen["rng"] = speech_feat.clone(), torch.get_rng_state().numpy()
        wav, source = hift_inference(speech_feat, cache_source)
        seen["hift"] = wav.clone()
        return wav, source

    model.t3.inference, model.s3gen.inference, model.s3gen.hift_inference = t3_run, s3_run, hift_run
    result = {}
    builtin = model.conds
    for i, case in enumerate(json.loads(cases_path.read_text())):
        model.conds = builtin
        seen["seed"], seen["max_new_tokens"] = int(case["seed"]), int(case["max_new_tokens"])
        seen["wave"] = case.get("wave", True)
        seen.pop("first", None)
        torch.manual_seed(seen["seed"])
        kwargs = {k: case[k] for k in ("temperature", "cfg_weight", "exaggeration", "repetition_penalty",
                                       "min_p", "top_p") if k in case}
        _watch_first_logits(model, seen)
        wav = model.generate(case["text"], audio_prompt_path=case.get("clip"), **kwargs)
        result[f"tokens_{i}"] = seen["tokens"][0].cpu().numpy()
        result[f"s3_tokens_{i}"] = seen["s3_tokens"].cpu().numpy()
        result[f"logits_{i}"] = seen["first"]
        result[f"wave_{i}"] = wav[0].cpu().numpy().astype(np.float32)
        if case.get("clip"):  # the clip's conditionals (`prepare_conditionals`)
            t3, gen = model.conds.t3, model.conds.gen
            for key, value in (("speaker_emb", t3.speaker_emb), ("t3_tokens", t3.cond_prompt_speech_tokens),
                               ("prompt_token", gen["prompt_token"]), ("prompt_feat", gen["prompt_feat"]),
                               ("xvector", gen["embedding"])):
                result[f"{key}_{i}"] = value.detach().cpu().numpy()
        if seen["wave"]:  # the vocoder's own input, RNG state and output (before the fade-in)
            result[f"mel_{i}"], result[f"rng_{i}"] = seen["mel"].cpu().numpy(), seen["rng"]
            result[f"hift_{i}"], result[f"flow_rng_{i}"] = seen["hift"].cpu().numpy(), seen["flow_rng"]
    np.savez(out, **result)


def _watch_first_logits(model, seen: dict) -> None:
    """Keep the first step's [cond, uncond] logits (the backend's first call each request)."""
    from chatterbox.models.t3.inference.t3_hf_backend import T3HuggingfaceBackend

    if getattr(T3HuggingfaceBackend, "_watched", False):
        return
    forward = T3HuggingfaceBackend.forward

    def watched(self, *a, **kw):
        out = forward(self, *a, **kw)
        if "first" not in seen:
            seen["first"] = out.logits[:, -1, :].float().cpu().numpy()
        return out
    T3HuggingfaceBackend.forward = watched
    T3HuggingfaceBackend._watched = True


if __name__ == "__main__":
    _stub_packages()
    shrink(Path(sys.argv[2]))
    if sys.argv[1] == "weights":
        weights(Path(sys.argv[2]), int(sys.argv[3]))
    elif sys.argv[1] == "generate":
        if len(sys.argv) > 5 and not (Path(sys.argv[2]) / "conds.pt").is_file():
            weights(Path(sys.argv[2]), int(sys.argv[5]))
        generate(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
    else:
        raise SystemExit(f"unknown command {sys.argv[1]!r}")
