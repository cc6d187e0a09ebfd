"""The `qwen-tts` package's side of the Qwen3-TTS tests, run as a script in the reference's
own venv (tests/qwen3_tts_checkpoints.py builds it: qwen-tts pins transformers 4.57.3).

    python qwen3_tts_reference.py weights FOLDER SEED
        random weights for the tiny checkpoint whose configs FOLDER holds (the talker in
        model.safetensors, the 12 Hz codec in speech_tokenizer/model.safetensors), from the
        package's own classes (so every parameter name is theirs)
    python qwen3_tts_reference.py generate FOLDER CASES.json OUT.npz
        what `Qwen3TTSModel.generate_custom_voice` runs (greedy: do_sample and
        subtalker_dosample off), the cases {"text", "speaker", "instruct", "max_new_tokens"}
        as one batch (the package's left-padded batch: its `generate` runs a nested
        `generate` a frame, so one batch costs what one case does): each case's codes
        [frames, groups] and the codec's waveform, as `codes_i` and `wave_i` in OUT.npz
    python qwen3_tts_reference.py speaker FOLDER WAVES.npz OUT.npz
        a Base checkpoint's speaker encoder: each 24 kHz clip's log mel and x-vector
        (`mel_i`, `emb_i`), with librosa's real mel filters (MSTAR_LIBROSA)
    python qwen3_tts_reference.py clone FOLDER CASES.json WAVES.npz OUT.npz
        a Base checkpoint's `generate_voice_clone` (x-vector mode, non-streaming text,
        greedy) of each case {"text", "clip", "max_new_tokens"}: `codes_i`, `wave_i`
    python qwen3_tts_reference.py encode FOLDER WAVES.npz OUT.npz
        the 12 Hz codec's encoder (`speech_tokenizer.encode`, one clip a call, as
        `create_voice_clone_prompt` makes `ref_code` of one clip): `codes_i` [frames, groups]
    python qwen3_tts_reference.py jobs JOBS.json
        each command of JOBS.json (a list of argument lists) in this one process
    python qwen3_tts_reference.py icl FOLDER CASES.json WAVES.npz OUT.npz
        a Base checkpoint's `generate_voice_clone` in ICL mode (the clip and its transcript,
        non-streaming text, greedy) of each case {"text", "clip", "ref_text",
        "max_new_tokens"} as one batch: `wave_i`, `codes_i` (the new codes), `ref_i` (the
        clip's codes)

A case may say `"non_streaming_mode": false` (the package's streaming text: one text token
fed with each generated frame), the same for every case of a batch.

The modules that do not load against the CPU torch here (torchaudio, and librosa, sox,
onnxruntime that only the 25 Hz codec, the speaker encoder and audio loading use) are
stubbed before the package is imported; nothing this script runs reaches them.
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


def _stub_audio_packages() -> None:
    """The stubs; librosa is the real one where MSTAR_LIBROSA names its folder (the
    speaker encoder's mel filters), put last on the path."""
    import os

    def unused(*_a, **_k):
        raise RuntimeError("stubbed in tests/qwen3_tts_reference.py")

    if os.environ.get("MSTAR_LIBROSA"):
        sys.path.append(os.environ["MSTAR_LIBROSA"])
        import librosa.filters  # noqa: F401
    else:
        _stub("librosa", load=unused, resample=unused)
        _stub("librosa.filters", mel=unused)
        sys.modules["librosa"].filters = sys.modules["librosa.filters"]  # type: ignore[attr-defined]
    torchaudio = _stub("torchaudio")
    compliance = _stub("torchaudio.compliance")
    kaldi = _stub("torchaudio.compliance.kaldi", fbank=unused)
    torchaudio.compliance, compliance.kaldi = compliance, kaldi  # type: ignore[attr-defined]
    _stub("sox", Transformer=unused)
    _stub("onnxruntime", InferenceSession=unused, SessionOptions=unused)


def _randomize(model, seed: int) -> None:
    """Every parameter drawn afresh (normal, std 0.2; norms and layer scales near 1 / their
    size), so no code path is flat: the package's own init leaves many at zero or one."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif "cluster_usage" in name:
                p.copy_(1.0 + 0.5 * noise.abs())
            elif name.endswith(("alpha", "beta")):
                p.copy_(0.2 * noise)
            elif "layer_scale" in name or name.endswith("gamma"):
                p.copy_(0.5 + 0.1 * noise)
            else:
                p.copy_(0.2 * noise)


def _scale_wave(decoder, seed: int) -> None:
    """The codec's last conv scaled so random codes make a waveform of std ~0.3: unscaled,
    nearly every sample is clamped to +-1, which would hide the codes."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, decoder.config.codebook_size, (1, decoder.config.num_quantizers, 24), generator=gen)
    with torch.no_grad():
        hidden = decoder.pre_conv(decoder.quantizer.decode(codes)).transpose(1, 2)
        hidden = decoder.pre_transformer(inputs_embeds=hidden).last_hidden_state.permute(0, 2, 1)
        for blocks in decoder.upsample:
            for block in blocks:
                hidden = block(hidden)
        for block in decoder.decoder:
            hidden = block(hidden)
        last = decoder.decoder[-1].conv
        last.weight.mul_(0.3 / float(hidden.std()))
        last.bias.mul_(0.3 / float(hidden.std()))


def _encoder_centroids(encoder, seed: int) -> None:
    """The encoder's codebooks (buffers, which `_randomize` leaves at zero: every clip would
    be code 0) drawn at its latents' scale (std ~1.5), so a clip's codes vary."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buf in sorted(encoder.named_buffers()):
            if name.endswith("codebook.embed_sum"):
                buf.copy_(1.5 * torch.randn(buf.shape, generator=gen))


def weights(folder: Path, seed: int) -> None:
    import torch
    from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration
    from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Config
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Model
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    cfg = Qwen3TTSConfig(**json.loads((folder / "config.json").read_text()))
    model = Qwen3TTSForConditionalGeneration(cfg)
    _randomize(model, seed)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    codec_dir = folder / "speech_tokenizer"
    codec_cfg = Qwen3TTSTokenizerV2Config(**json.loads((codec_dir / "config.json").read_text()))
    codec = Qwen3TTSTokenizerV2Model(codec_cfg)
    _randomize(codec, seed + 1)
    _scale_wave(codec.decoder, seed)
    _encoder_centroids(codec.encoder, seed + 2)
    save_file({k: v.contiguous() for k, v in codec.state_dict().items()}, str(codec_dir / "model.safetensors"),
              metadata={"format": "pt"})


def _non_streaming(cases: list[dict]) -> bool:
    """The batch's text mode: the package's non-streaming text (all the text in the prompt)
    unless the cases say `"non_streaming_mode": false` (one text token fed a step); one
    `generate` call, so one mode for all."""
    modes = {bool(c.get("non_streaming_mode", True)) for c in cases}
    if len(modes) != 1:
        raise SystemExit("the cases run as one batch: one non_streaming_mode")
    return modes.pop()


def generate(folder: Path, cases_path: Path, out: Path) -> None:
    import numpy as np
    import torch
    from qwen_tts import Qwen3TTSModel

    model = Qwen3TTSModel.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager")
    cases = json.loads(cases_path.read_text())
    if len({c["max_new_tokens"] for c in cases}) != 1:
        raise SystemExit("the cases run as one batch: one max_new_tokens")
    codes, _ = model.model.generate(
        input_ids=model._tokenize_texts([model._build_assistant_text(c["text"]) for c in cases]),
        instruct_ids=[model._tokenize_texts([model._build_instruct_text(c["instruct"])])[0]
                      if c.get("instruct") else None for c in cases],
        languages=[c.get("language", "Auto") for c in cases], speakers=[c["speaker"] for c in cases],
        non_streaming_mode=_non_streaming(cases),
        **model._merge_generate_kwargs(do_sample=False, subtalker_dosample=False,
                                       max_new_tokens=cases[0]["max_new_tokens"]))
    wavs, rate = model.model.speech_tokenizer.decode([{"audio_codes": c} for c in codes])
    result = {"rate": np.asarray(rate)}
    for i, (c, w) in enumerate(zip(codes, wavs)):
        result[f"codes_{i}"] = c.cpu().numpy()
        result[f"wave_{i}"] = np.asarray(w, dtype=np.float32)
    np.savez(out, **result)


def speaker(folder: Path, waves_path: Path, out: Path) -> None:
    """The package's log mel (`mel_spectrogram` as `extract_speaker_embedding` calls it)
    and x-vector (`extract_speaker_embedding`) of each clip in WAVES.npz."""
    import numpy as np
    import torch
    from qwen_tts import Qwen3TTSModel
    from qwen_tts.core.models.modeling_qwen3_tts import mel_spectrogram

    model = Qwen3TTSModel.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").model
    result = {}
    with np.load(waves_path) as waves:
        for i in range(len(waves.files)):
            wave = waves[f"wave_{i}"]
            mel = mel_spectrogram(torch.from_numpy(wave).unsqueeze(0), n_fft=1024, num_mels=128, sampling_rate=24000,
                                  hop_size=256, win_size=1024, fmin=0, fmax=12000).transpose(1, 2)
            result[f"mel_{i}"] = mel[0].numpy()
            result[f"emb_{i}"] = model.extract_speaker_embedding(wave, 24000).float().numpy()
    np.savez(out, **result)


def clone(folder: Path, cases_path: Path, waves_path: Path, out: Path) -> None:
    """`Qwen3TTSModel.generate_voice_clone(x_vector_only_mode=True, non_streaming_mode=True)`
    greedy, the cases {"text", "clip", "max_new_tokens"} (clip: an index into WAVES.npz,
    24 kHz) as one batch: each case's waveform (`wave_i`), and its codes (`codes_i`: the
    same `generate` call on the same voice-clone prompt)."""
    import numpy as np
    import torch
    from qwen_tts import Qwen3TTSModel
    from qwen_tts.inference.qwen3_tts_model import VoiceClonePromptItem

    model = Qwen3TTSModel.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager")
    cases = json.loads(cases_path.read_text())
    with np.load(waves_path) as w:
        clips = [(w[f"wave_{c['clip']}"], 24000) for c in cases]
    greedy = {"do_sample": False, "subtalker_dosample": False, "max_new_tokens": cases[0]["max_new_tokens"]}
    texts = [c["text"] for c in cases]
    # `create_voice_clone_prompt`'s items for x-vector mode, less the codec encoding it runs
    # and then drops (ref_code None)
    items = [VoiceClonePromptItem(ref_code=None, ref_spk_embedding=model.model.extract_speaker_embedding(w, sr),
                                  x_vector_only_mode=True, icl_mode=False, ref_text=None) for w, sr in clips]
    wavs, _ = model.generate_voice_clone(texts, language="Auto", voice_clone_prompt=items,
                                         non_streaming_mode=_non_streaming(cases),
                                         **greedy)
    codes, _ = model.model.generate(
        input_ids=model._tokenize_texts([model._build_assistant_text(t) for t in texts]), ref_ids=[None] * len(texts),
        voice_clone_prompt=model._prompt_items_to_voice_clone_prompt(items), languages=["Auto"] * len(texts),
        non_streaming_mode=_non_streaming(cases), **model._merge_generate_kwargs(**greedy))
    result = {}
    for i, (c, wav) in enumerate(zip(codes, wavs)):
        result[f"codes_{i}"] = c.cpu().numpy()
        result[f"wave_{i}"] = np.asarray(wav, dtype=np.float32)
    np.savez(out, **result)


def encode(folder: Path, waves_path: Path, out: Path) -> None:
    """`speech_tokenizer.encode` of each 24 kHz clip in WAVES.npz alone."""
    import numpy as np
    import torch
    from qwen_tts import Qwen3TTSModel

    model = Qwen3TTSModel.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager")
    result = {}
    with np.load(waves_path) as waves:
        for i in range(len(waves.files)):
            enc = model.model.speech_tokenizer.encode(waves[f"wave_{i}"], sr=24000)
            result[f"codes_{i}"] = enc.audio_codes[0].cpu().numpy()
    np.savez(out, **result)


def icl(folder: Path, cases_path: Path, waves_path: Path, out: Path) -> None:
    """`generate_voice_clone(x_vector_only_mode=False, non_streaming_mode=True)` greedy: each
    case's prompt item made by `create_voice_clone_prompt` of its clip and transcript alone
    (what `generate_voice_clone(ref_audio=clip, ref_text=...)` makes), the cases as one
    batch; its waveform (the package's cut of the clip's part included), and its new codes
    from the same `generate` call on the same prompt."""
    import numpy as np
    import torch
    from qwen_tts import Qwen3TTSModel

    model = Qwen3TTSModel.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager")
    cases = json.loads(cases_path.read_text())
    with np.load(waves_path) as w:
        clips = [(w[f"wave_{c['clip']}"], 24000) for c in cases]
    greedy = {"do_sample": False, "subtalker_dosample": False, "max_new_tokens": cases[0]["max_new_tokens"]}
    texts = [c["text"] for c in cases]
    items = [model.create_voice_clone_prompt(ref_audio=clip, ref_text=c["ref_text"], x_vector_only_mode=False)[0]
             for clip, c in zip(clips, cases)]
    wavs, _ = model.generate_voice_clone(texts, language="Auto", voice_clone_prompt=items,
                                         non_streaming_mode=_non_streaming(cases),
                                         **greedy)
    ref_ids = [model._tokenize_texts([model._build_ref_text(c["ref_text"])])[0] for c in cases]
    codes, _ = model.model.generate(
        input_ids=model._tokenize_texts([model._build_assistant_text(t) for t in texts]), ref_ids=ref_ids,
        voice_clone_prompt=model._prompt_items_to_voice_clone_prompt(items), languages=["Auto"] * len(texts),
        non_streaming_mode=_non_streaming(cases), **model._merge_generate_kwargs(**greedy))
    result = {}
    for i, (c, wav, item) in enumerate(zip(codes, wavs, items)):
        result[f"codes_{i}"] = c.cpu().numpy()
        result[f"wave_{i}"] = np.asarray(wav, dtype=np.float32)
        result[f"ref_{i}"] = item.ref_code.cpu().numpy()
    np.savez(out, **result)


def jobs(jobs_path: Path) -> None:
    """Each command of JOBS.json (a list of argument lists) in this one process."""
    for args in json.loads(jobs_path.read_text()):
        main(args)


def main(argv: list[str]) -> None:
    commands = {"weights": lambda a: weights(Path(a[0]), int(a[1])), "generate": generate, "speaker": speaker,
                "clone": clone, "encode": encode, "icl": icl, "jobs": jobs}
    if argv[0] not in commands:
        raise SystemExit(f"unknown command {argv[0]!r}")
    if argv[0] == "weights":
        commands["weights"](argv[1:])
    else:
        commands[argv[0]](*(Path(a) for a in argv[1:]))


if __name__ == "__main__":
    _stub_audio_packages()
    main(sys.argv[1:])
