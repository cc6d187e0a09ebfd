"""Tiny random text-to-speech checkpoints (no download): a SNAC codec folder in the Hub's
layout of hubertsiuzdak/snac_24khz, and an Orpheus-style Llama whose added tokens
`<custom_token_N>` carry the SNAC codes."""

from __future__ import annotations

import json
from pathlib import Path

from tests.checkpoints import make_tokenizer

#: snac_24khz's config with the widths cut down: same rates, strides and kernels (so the same
#: 2048 samples a frame and the same receptive field in frames), noise blocks, no attention
TINY_SNAC = dict(sampling_rate=24000, encoder_dim=4, encoder_rates=[2, 4, 8, 8], decoder_dim=32,
                 decoder_rates=[8, 8, 4, 2], attn_window_size=None, codebook_dim=8, vq_strides=[4, 2, 1],
                 noise=True, depthwise=True)
#: Orpheus' control tokens precede the audio tokens: <custom_token_10> is the first code
ORPHEUS_AUDIO_OFFSET = 10


def make_snac_folder(path: Path, seed: int = 0, codebook_size: int = 64, legacy_weight_norm: bool = False,
                     **overrides) -> Path:
    """Save a seeded random tiny SNAC as config.json + pytorch_model.bin. `legacy_weight_norm`
    writes weight norm as `weight_g`/`weight_v` (the form older torch saved) instead of the
    parametrization's `parametrizations.weight.original0/1`. The Snake alphas and biases are
    randomized too (SNAC inits them to 1 and 0, which would hide a mix-up)."""
    import torch
    from snac import SNAC

    path.mkdir(parents=True, exist_ok=True)
    config = {**TINY_SNAC, "codebook_size": codebook_size, **overrides}
    torch.manual_seed(seed)
    model = SNAC(**config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("alpha"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
    state = model.state_dict()
    if legacy_weight_norm:
        renames = {".parametrizations.weight.original0": ".weight_g", ".parametrizations.weight.original1": ".weight_v"}
        state = {_rename(key, renames): value for key, value in state.items()}
    torch.save(state, path / "pytorch_model.bin")
    (path / "config.json").write_text(json.dumps(config))
    return path


def _rename(key: str, renames: dict[str, str]) -> str:
    """`key` with the first matching suffix of `renames` replaced."""
    for old, new in renames.items():
        if key.endswith(old):
            return key[: -len(old)] + new
    return key


def orpheus_tokens(codebook_size: int = 64) -> list[str]:
    """Llama 3's two specials Orpheus uses, then <custom_token_0 .. 10 + 7 * codebook_size - 1>
    (contiguous ids, as in the real vocab from 128256)."""
    count = ORPHEUS_AUDIO_OFFSET + 7 * codebook_size
    return ["<|begin_of_text|>", "<|eot_id|>"] + [f"<custom_token_{n}>" for n in range(count)]


def llama3_tokenizer(path: Path, specials: list[str], config: dict, small_ids: bool = False) -> None:
    """tests.checkpoints' byte-level BPE plus `specials`; like Llama 3's tokenizer it writes
    <|begin_of_text|> before the text; tokenizer_config.json is `config` over the fast
    tokenizer's class and that bos. `small_ids`: the specials take ids 3, 4, ... (trained
    in), not ids past the vocabulary's."""
    from tokenizers import Tokenizer, processors

    make_tokenizer(path, extra_specials=tuple(specials) if small_ids else ())
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens(specials)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B",
                                                       special_tokens=[("<|begin_of_text|>", bos)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "model_max_length": 4096,
        **config}))


def make_orpheus_tokenizer(path: Path, codebook_size: int = 64) -> None:
    """Orpheus' added tokens on a Llama 3-like tokenizer; its eos is end_of_speech (<custom_token_2>)."""
    llama3_tokenizer(path, orpheus_tokens(codebook_size),
                     {"eos_token": "<custom_token_2>", "pad_token": "<|endoftext|>"})


def make_orpheus_checkpoint(path: Path, seed: int = 0, codebook_size: int = 64, **shape) -> Path:
    """A tiny random LlamaForCausalLM (hidden 64, 2 layers) with an Orpheus tokenizer whose
    audio tokens cover `codebook_size` codes per slot (pair it with make_snac_folder's
    codec of the same size); eos is end_of_speech, Orpheus' stop token. `shape` changes
    the Llama's sizes (the bench's larger one)."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    path.mkdir(parents=True, exist_ok=True)
    make_orpheus_tokenizer(path, codebook_size)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    cfg = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), **{**dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                   num_attention_heads=4, num_key_value_heads=2), **shape},
        max_position_embeddings=2048, rms_norm_eps=1e-6,
        bos_token_id=tok.token_to_id("<|begin_of_text|>"), eos_token_id=tok.token_to_id("<custom_token_2>"),
        pad_token_id=0, initializer_range=0.2, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path, safe_serialization=True)
    return path


# -- CSM (Sesame's Conversational Speech Model) ------------------------------------------

#: Llama 3's specials the CSM processor and chat template use
CSM_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|AUDIO|>", "<|audio_eos|>"]
#: sesame/csm-1b's chat template (its processor's, as transformers' conversion writes it)
CSM_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- bos_token }}{{- '[' + message['role'] + ']' }}"
    "{{- message['content'][0]['text'] }}{{- eos_token }}"
    "{%- if message['content']|length > 1 %}{{- '<|AUDIO|><|audio_eos|>' }}{%- endif %}{%- endfor %}"
)
#: Mimi with kyutai/mimi's rates (24 kHz, upsampling 8 x 6 x 5 x 4, x2 latent stride: 1920
#: samples a frame at 12.5 frames/s) and kernels, the widths cut down
TINY_MIMI = dict(hidden_size=32, num_filters=4, num_residual_layers=1, upsampling_ratios=[8, 6, 5, 4],
                 codebook_dim=16, vector_quantization_hidden_dimension=16, upsample_groups=32,
                 num_hidden_layers=2, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
                 head_dim=16, sliding_window=250, max_position_embeddings=8000)
#: Llama 3.2's RoPE, as sesame/csm-1b's backbone and depth decoder configs have it
CSM_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "high_freq_factor": 4.0,
            "low_freq_factor": 1.0, "original_max_position_embeddings": 8192}


def make_csm_tokenizer(path: Path, small_ids: bool = False) -> None:
    """CSM's specials on a Llama 3-like tokenizer (the CSM processor tokenizes without the
    bos: the template writes its own), eos <|end_of_text|>, and CSM's chat template."""
    llama3_tokenizer(path, CSM_TOKENS, {"eos_token": "<|end_of_text|>", "pad_token": "<|AUDIO|>",
                                        "chat_template": CSM_CHAT_TEMPLATE}, small_ids)


def make_csm_checkpoint(path: Path, seed: int = 0, num_codebooks: int = 32, codebook_size: int = 64,
                        depth: dict | None = None, mimi: dict | None = None, small_ids: bool = False,
                        **shape) -> Path:
    """A tiny random CsmForConditionalGeneration (backbone hidden 64 x 2 layers, depth
    decoder 32 x 2 layers, `num_codebooks` codebooks of `codebook_size` codes, a tiny Mimi
    with the real rates), saved as transformers saves it (config.json with the depth
    decoder's and the codec's configs nested, one safetensors with codec_model.* inside)
    with a CSM tokenizer. The codebook vocabulary equals Mimi's codebook size (the real
    model's 2051 has 3 ids past Mimi's 2048 that its codec cannot decode). `shape`, `depth`
    and `mimi` change the backbone's, the depth decoder's and the codec's sizes (the bench's
    larger one). `small_ids`: CSM's specials take ids 3-6 (the audio placeholder 5)."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    path.mkdir(parents=True, exist_ok=True)
    make_csm_tokenizer(path, small_ids)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    backbone = {**dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2), **shape}
    depth_cfg = {**dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2), **(depth or {})}
    codec = transformers.MimiConfig(**{**TINY_MIMI, **(mimi or {}), "codebook_size": codebook_size,
                                       "num_quantizers": num_codebooks})
    cfg = transformers.CsmConfig(
        num_codebooks=num_codebooks, vocab_size=codebook_size, text_vocab_size=tok.get_vocab_size(), **backbone,
        max_position_embeddings=2048, rms_norm_eps=1e-5, rope_parameters=dict(CSM_ROPE),
        bos_token_id=tok.token_to_id("<|begin_of_text|>"), pad_token_id=tok.token_to_id("<|AUDIO|>"),
        audio_token_id=tok.token_to_id("<|AUDIO|>"), audio_eos_token_id=tok.token_to_id("<|audio_eos|>"),
        codebook_pad_token_id=codebook_size - 1, codebook_eos_token_id=0, initializer_range=0.2,
        depth_decoder_config=dict(num_codebooks=num_codebooks, backbone_hidden_size=backbone["hidden_size"],
                                  vocab_size=codebook_size, max_position_embeddings=num_codebooks + 1,
                                  rms_norm_eps=1e-5, rope_parameters=dict(CSM_ROPE), initializer_range=0.2,
                                  **depth_cfg),
        codec_config=codec.to_dict())
    torch.manual_seed(seed)
    model = transformers.CsmForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # Mimi's codebooks as trained ones look (its init leaves usage at 0)
        for name, buf in model.codec_model.named_buffers():
            if name.endswith("cluster_usage"):
                buf.uniform_(0.5, 2.0)
            elif name.endswith("embed_sum"):
                buf.normal_(0.0, 1.0)
        for name, param in model.codec_model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
        last = model.codec_model.decoder.decoder_seanet.layers[-1].conv  # sound within [-1, 1], as 16-bit PCM holds
        last.weight.mul_(0.01)
        last.bias.mul_(0.01)
    model.save_pretrained(path, safe_serialization=True)
    return path


def csm_reference(path: Path, turns: list[tuple[str, str]], max_frames: int):
    """transformers' greedy CSM for each `(speaker, text)` turn, one at a time: (the
    frames [n, num_codebooks] `generate` returns, its EOS frame included, the sound
    `MimiModel.decode` makes of the frames before the first all-zero one); the prompt as
    the CSM processor's chat template renders and tokenizes it."""
    import torch
    import transformers

    model = transformers.CsmForConditionalGeneration.from_pretrained(path).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    out = []
    for speaker, text in turns:
        rendered = tok.apply_chat_template([{"role": speaker, "content": [{"type": "text", "text": text}]}],
                                           tokenize=False)
        ids = tok(rendered, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            frames = model.generate(input_ids=ids, max_new_tokens=max_frames, do_sample=False,
                                    depth_decoder_do_sample=False)[0]
            zero = (frames == model.config.codebook_eos_token_id).all(dim=-1).nonzero()
            cut = int(zero.min()) if zero.numel() else frames.shape[0]
            sound = model.codec_model.decode(frames[:cut].t().unsqueeze(0)).audio_values[0, 0] if cut else None
        out.append((frames.numpy(), sound.numpy() if sound is not None else torch.zeros(0).numpy()))
    return out


def chirp(n: int, f0: float, rate: int = 24000):
    """`n` samples of a rising tone from `f0` Hz (float32): context audio for CSM tests."""
    import numpy as np

    t = np.arange(n) / rate
    return (0.4 * np.sin(2 * np.pi * (f0 + 300 * t) * t)).astype(np.float32)


def audio_file(samples, rate: int = 24000, fmt: str = "WAV", subtype: str = "FLOAT") -> bytes:
    """`samples` as a file (float WAV by default: the samples exactly)."""
    import io

    import soundfile

    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def csm_context_reference(path: Path, conversations: list[list[tuple[str, str, object]]], max_frames: int):
    """transformers' greedy CSM continuing each conversation (turns `(speaker, text,
    audio)`, audio a float32 array at 24 kHz or None; the last turn is the one to speak),
    one at a time: (the frames `generate` returns, the sound `MimiModel.decode` makes of
    those before the first all-zero one). The inputs are the CSM processor's
    (`apply_chat_template`: input_ids with the audio placeholders, input_values, cutoffs)."""
    import torch
    import transformers

    model = transformers.CsmForConditionalGeneration.from_pretrained(path).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    extractor = transformers.EncodecFeatureExtractor(feature_size=1, sampling_rate=24000, padding_value=0.0)
    processor = transformers.CsmProcessor(extractor, tok, chat_template=tok.chat_template)
    out = []
    for turns in conversations:
        conv = [{"role": speaker, "content": [{"type": "text", "text": text}]
                 + ([{"type": "audio", "audio": audio}] if audio is not None else [])}
                for speaker, text, audio in turns]
        inputs = processor.apply_chat_template(conv, tokenize=True, return_dict=True)
        with torch.no_grad():
            frames = model.generate(**inputs, max_new_tokens=max_frames, do_sample=False,
                                    depth_decoder_do_sample=False)[0]
            zero = (frames == model.config.codebook_eos_token_id).all(dim=-1).nonzero()
            cut = int(zero.min()) if zero.numel() else frames.shape[0]
            sound = model.codec_model.decode(frames[:cut].t().unsqueeze(0)).audio_values[0, 0] if cut else None
        out.append((frames.numpy(), sound.numpy() if sound is not None else torch.zeros(0).numpy()))
    return out


def openai_speech(url: str, voice: str, text: str, extra: dict) -> tuple[bytes, bytes]:
    """The official openai client against a server's /v1/audio/speech, pcm: (the whole clip
    from `audio.speech.create`, the chunks of `with_streaming_response` joined)."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    clip = client.audio.speech.create(model=model, voice=voice, input=text, response_format="pcm", extra_body=extra)
    with client.audio.speech.with_streaming_response.create(model=model, voice=voice, input=text,
                                                            response_format="pcm", extra_body=extra) as r:
        streamed = b"".join(r.iter_bytes())
    return clip.content, streamed
