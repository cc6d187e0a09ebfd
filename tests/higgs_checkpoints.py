"""Tiny random Higgs Audio v2 checkpoints (no download), laid out as the Hub ships them:

- the generation model's folder (bosonai/higgs-audio-v2-generation-3B-base as transformers
  converts it): config.json (`HiggsAudioV2Config`), model.safetensors, a Llama 3-like
  tokenizer with Higgs' specials and a Llama 3-style chat template whose generation
  prompt opens the assistant's audio (`<|audio_out_bos|>`), generation_config.json, and
  processor_config.json naming the codec by its Hub id
  (`audio_tokenizer_name_or_path`: bosonai/higgs-audio-v2-tokenizer);
- the codec (`HiggsAudioV2TokenizerModel`, an X-codec: RVQ + DAC decoder, HuBERT
  semantic encoder) in a Hugging Face cache folder (`models--bosonai--...`), where
  transformers' processor finds it by that id.

The reference is transformers' own `generate` (greedy) and `HiggsAudioV2Processor.decode`
(delay pattern reverted, codec decode).

The venv has no torchaudio; transformers' codec module imports it at its top and uses
it only to resample for the semantic encoder (`encode`). `_codec_class` puts a module in
its place before importing the codec whose one function is torchaudio's `resample`,
transcribed (`_torchaudio_resample`); everything else of the codec runs as shipped.
"""

from __future__ import annotations

import importlib
import json
import sys
import types
from pathlib import Path

from tests.tts_checkpoints import llama3_tokenizer

CODEC_REPO = "bosonai/higgs-audio-v2-tokenizer"
#: Llama 3's specials the chat template writes, and Higgs' own
HIGGS_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",
                "<|audio_out_bos|>", "<|AUDIO_OUT|>", "<|audio_eos|>", "<|reserved_special_token_6|>",
                "<|AUDIO|>", "<|audio_bos|>", "<|scene_desc_start|>", "<|scene_desc_end|>"]
#: Llama 3's chat template over text parts (or plain strings); the generation prompt opens
#: the assistant's audio output, as Higgs' template does
HIGGS_CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- elif part['type'] == 'audio' %}{{- '<|audio_out_bos|><|AUDIO_OUT|><|audio_eos|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}{{- '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n<|audio_out_bos|>' }}"
    "{%- endif %}"
)
#: X-codec's rates (24 kHz, DAC hop 8 x 5 x 4 x 2 x 3 = 960: 25 frames a second, 8
#: codebooks of 1024 at 2 kbps) with the widths cut down
TINY_ACOUSTIC = dict(encoder_hidden_size=4, downsampling_ratios=[8, 5, 4, 2, 3], decoder_hidden_size=64,
                     upsampling_ratios=[8, 5, 4, 2, 3], hidden_size=16, sampling_rate=24000)
TINY_SEMANTIC = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                     conv_dim=[8] * 7, num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
                     mask_time_prob=0.0)
#: how much codebook 0's EOS row of the audio head is scaled: some inputs end in ~20 frames
EOS_LIFT = 2.5
SCENE = "Audio is recorded from a quiet room."


def _codec_class():
    """transformers' `HiggsAudioV2TokenizerModel` (see the module's note on torchaudio)."""
    import transformers

    try:
        import torchaudio  # noqa: F401
    except ImportError:
        stub = types.ModuleType("torchaudio")
        stub.functional = types.SimpleNamespace(resample=_torchaudio_resample)  # type: ignore[attr-defined]
        sys.modules.setdefault("torchaudio", stub)
    mod = importlib.import_module("transformers.models.higgs_audio_v2_tokenizer.modeling_higgs_audio_v2_tokenizer")
    return transformers.HiggsAudioV2TokenizerConfig, mod.HiggsAudioV2TokenizerModel


def _torchaudio_resample(waveform, orig_freq: int, new_freq: int, lowpass_filter_width: int = 6,
                         rolloff: float = 0.99):
    """torchaudio.functional.resample (its default windowed sinc, "sinc_interp_hann"),
    transcribed from torchaudio 2.x's `_get_sinc_resample_kernel` and
    `_apply_sinc_resample_kernel`, for the codec's encoder where torchaudio is missing."""
    import math

    import torch

    gcd = math.gcd(int(orig_freq), int(new_freq))
    orig, new = int(orig_freq) // gcd, int(new_freq) // gcd
    base_freq = min(orig, new) * rolloff
    width = math.ceil(lowpass_filter_width * orig / base_freq)
    idx = torch.arange(-width, width + orig, dtype=waveform.dtype)[None, None] / orig
    t = torch.arange(0, -new, -1, dtype=waveform.dtype)[:, None, None] / new + idx
    t *= base_freq
    t = t.clamp_(-lowpass_filter_width, lowpass_filter_width)
    window = torch.cos(t * math.pi / lowpass_filter_width / 2) ** 2
    t *= math.pi
    scale = base_freq / orig
    kernels = torch.where(t == 0, torch.tensor(1.0).to(t), t.sin() / t)
    kernels *= window * scale
    shape = waveform.size()
    wav = waveform.reshape(-1, shape[-1])
    num_wavs, length = wav.shape
    wav = torch.nn.functional.pad(wav, (width, width + orig))
    out = torch.nn.functional.conv1d(wav[:, None], kernels, stride=orig)
    out = out.transpose(1, 2).reshape(num_wavs, -1)
    target = math.ceil(new * length / orig)
    return out[..., :target].reshape(shape[:-1] + out[..., :target].shape[-1:])


def hub_cache_folder(cache: Path, repo: str = CODEC_REPO, revision: str = "0" * 40) -> Path:
    """The snapshot folder of `repo` in a Hugging Face hub cache at `cache` (refs/main names it)."""
    base = cache / ("models--" + repo.replace("/", "--"))
    (base / "refs").mkdir(parents=True, exist_ok=True)
    (base / "refs" / "main").write_text(revision)
    return base / "snapshots" / revision


def make_higgs_codec(path: Path, seed: int = 0) -> Path:
    """A seeded random tiny HiggsAudioV2TokenizerModel saved by `save_pretrained`. Its
    codebooks, Snake alphas and biases are randomized (the init leaves codebooks at 0,
    alphas at 1, biases at 0, which would hide a mix-up), and the decoder's weights have unit
    gain, so the sound depends on the codes (the last conv scales it back into [-1, 1])."""
    import torch

    config_cls, model_cls = _codec_class()
    path.mkdir(parents=True, exist_ok=True)
    cfg = config_cls(acoustic_model_config=dict(TINY_ACOUSTIC), semantic_model_config=dict(TINY_SEMANTIC),
                     target_bandwidths=[0.5, 1, 1.5, 2], codebook_size=1024, codebook_dim=8)
    assert cfg.num_quantizers == 8 and cfg.hop_length == 960, (cfg.num_quantizers, cfg.hop_length)
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("codebook.embed"):
                buf.normal_(0.0, 1.0)
        for name, param in model.named_parameters():
            if name.endswith("alpha"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif name.startswith(("quantizer.", "fc2.")) and name.endswith("weight"):
                param.normal_(0.0, param.shape[1] ** -0.5)  # unit gain: the init's 0.02 drowns the codes
            elif name.startswith("acoustic_decoder.") and name.endswith("weight"):  # conv [out, in, k]
                taps = param.shape[0] * 2 if "conv_t" in name else param.shape[1] * param.shape[2]
                param.normal_(0.0, taps ** -0.5)  # (a transposed conv's output sees 2 of its k taps a channel)
        for p in model.acoustic_decoder.conv2.parameters():  # sound within [-1, 1], as 16-bit PCM holds
            p.mul_(4e-4)
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_higgs_tokenizer(path: Path) -> None:
    llama3_tokenizer(path, HIGGS_TOKENS, {"eos_token": "<|end_of_text|>", "pad_token": "<|end_of_text|>",
                                          "chat_template": HIGGS_CHAT_TEMPLATE})


def make_higgs_checkpoint(path: Path, seed: int = 0, generation: dict | None = None, **shape) -> Path:
    """A tiny random HiggsAudioV2ForConditionalGeneration (hidden 64 x 2 layers, 8
    codebooks of 1024 codes + stream BOS / EOS), with its tokenizer, generation_config.json
    (Boson's sampling, RAS included, over `generation`) and processor_config.json naming
    the codec by its Hub id. The audio head's EOS columns are lifted a little so that some
    inputs end within a few dozen frames (a random model otherwise never ends)."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    path.mkdir(parents=True, exist_ok=True)
    make_higgs_tokenizer(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in HIGGS_TOKENS}
    cfg = transformers.HiggsAudioV2Config(
        vocab_size=tok.get_vocab_size(), **{**dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16),
                                            **shape},
        max_position_embeddings=2048, rms_norm_eps=1e-5, num_codebooks=8, codebook_size=1026,
        audio_token_id=ids["<|AUDIO_OUT|>"], audio_bos_token_id=ids["<|audio_out_bos|>"],
        audio_delay_token_id=ids["<|reserved_special_token_6|>"], audio_stream_bos_id=1024,
        audio_stream_eos_id=1025, bos_token_id=ids["<|begin_of_text|>"], eos_token_id=ids["<|eot_id|>"],
        pad_token_id=ids["<|end_of_text|>"], initializer_range=0.2)
    torch.manual_seed(seed)
    model = transformers.HiggsAudioV2ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm" in name or name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)  # the audio and text norms differ, so a mix-up shows
        model.audio_lm_head.weight[1025].mul_(EOS_LIFT)  # codebook 0's stream EOS
    model.save_pretrained(path, safe_serialization=True)
    gen = {"do_sample": True, "temperature": 1.0, "top_k": 50, "top_p": 0.95, "ras_win_len": 7,
           "ras_win_max_num_repeat": 2, "max_new_tokens": 2048, "bos_token_id": cfg.bos_token_id,
           "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id, **(generation or {})}
    (path / "generation_config.json").write_text(json.dumps(gen))
    (path / "processor_config.json").write_text(json.dumps({
        "processor_class": "HiggsAudioV2Processor", "audio_stream_bos_id": 1024, "audio_stream_eos_id": 1025,
        "audio_tokenizer": {"audio_tokenizer_class": "HiggsAudioV2TokenizerModel",
                            "audio_tokenizer_name_or_path": CODEC_REPO}}))
    return path


def system_message(voice: str = "default", scene: str = SCENE) -> str:
    """Boson's generation.py system turn: the instruction, then the scene description (and
    the speaker's, for a voice other than default) between the scene markers."""
    desc = scene if voice == "default" else f"{scene}\n\nSPEAKER0: {voice}"
    return f"Generate audio following instruction.\n\n<|scene_desc_start|>\n{desc}\n<|scene_desc_end|>"


def higgs_prompt_ids(folder: Path, text: str, voice: str = "default") -> list[int]:
    """The chat template over the system turn and the text, tokenized as transformers does
    (the template writes the specials)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "system", "content": [{"type": "text", "text": system_message(voice)}]},
                {"role": "user", "content": [{"type": "text", "text": text}]}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(rendered, add_special_tokens=False).input_ids


def higgs_reference(folder: Path, codec: Path, turns: list[tuple[str, str]], max_frames: int):
    """transformers' greedy Higgs for each `(voice, text)`, one at a time: (the frames
    [n, 8] `generate` returns, delay pattern and stream BOS / EOS included; the sound
    `HiggsAudioV2Processor.decode` makes of them). RAS is off (`ras_win_len=None`): under
    greedy, transformers' RAS would draw from a softmax, and a greedy request is argmax."""
    import torch
    import transformers

    _, codec_cls = _codec_class()
    model = transformers.HiggsAudioV2ForConditionalGeneration.from_pretrained(folder).eval()
    # the processor's own decode (its constructor's class check wants the lazy module's codec class)
    processor = object.__new__(transformers.HiggsAudioV2Processor)
    processor.audio_stream_bos_id, processor.audio_stream_eos_id = 1024, 1025
    processor.audio_tokenizer = codec_cls.from_pretrained(codec).eval()
    out = []
    for voice, text in turns:
        ids = torch.tensor([higgs_prompt_ids(folder, text, voice)])
        with torch.no_grad():
            frames = model.generate(input_ids=ids, max_new_tokens=max_frames, do_sample=False, ras_win_len=None)
            wave = processor.decode(frames) if frames.shape[1] > 8 else torch.zeros(0)
        out.append((frames[0].numpy(), wave.float().numpy().reshape(-1)))
    return out


def _processor(folder: Path, codec: Path):
    """transformers' HiggsAudioV2Processor over the checkpoint's tokenizer and the codec (its
    constructor's class check wants the lazy module's codec class, which needs torchaudio:
    the attributes are set as the constructor sets them)."""
    import transformers

    _, codec_cls = _codec_class()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    processor = object.__new__(transformers.HiggsAudioV2Processor)
    processor.tokenizer = tok
    processor.feature_extractor = transformers.DacFeatureExtractor(sampling_rate=24000, hop_length=960)
    processor.audio_tokenizer = codec_cls.from_pretrained(codec).eval()
    processor.audio_stream_bos_id, processor.audio_stream_eos_id = 1024, 1025
    for name, token in (("audio_token", "<|AUDIO_OUT|>"), ("audio_bos_token", "<|audio_out_bos|>"),
                        ("audio_eos_token", "<|audio_eos|>"), ("audio_delay_token", "<|reserved_special_token_6|>")):
        setattr(processor, name, token)
        setattr(processor, name + "_id", tok.convert_tokens_to_ids(token))
    return processor


def higgs_clone_reference(folder: Path, codec: Path, items: list[tuple[str, object, str]], max_frames: int):
    """transformers' greedy Higgs cloning a voice, for each `(reference text, reference clip
    (float32 at 24 kHz), text)`: the conversation system, user (the reference text),
    assistant (the clip), user (the text), as the processor lays it out (the clip encoded,
    its codes framed by the stream BOS / EOS in the delay pattern, one placeholder row a
    frame); (the frames `generate` made after the clip's, the processor's decode of them)."""
    import torch
    import transformers

    model = transformers.HiggsAudioV2ForConditionalGeneration.from_pretrained(folder).eval()
    processor = _processor(folder, codec)
    out = []
    for ref_text, clip, text in items:
        messages = [{"role": "system", "content": [{"type": "text", "text": system_message()}]},
                    {"role": "user", "content": [{"type": "text", "text": ref_text}]},
                    {"role": "assistant", "content": [{"type": "audio"}]},
                    {"role": "user", "content": [{"type": "text", "text": text}]}]
        rendered = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = transformers.HiggsAudioV2Processor.__call__(processor, text=rendered, audio=[clip],
                                                             return_tensors="pt", add_special_tokens=False,
                                                             sampling_rate=24000)
        context = inputs["audio_input_ids"].shape[1]
        with torch.no_grad():
            frames = model.generate(**inputs, max_new_tokens=max_frames, do_sample=False, ras_win_len=None)
            wave = processor.decode(frames)
        out.append((frames[0, context:].numpy(), wave.float().numpy().reshape(-1), inputs["input_ids"][0].tolist()))
    return out
