"""Tiny random-weight Whisper checkpoints made with transformers (nothing is downloaded).

The folder looks like a real Hugging Face Whisper folder: config.json + model.safetensors
(save_pretrained; proj_out tied to the decoder's embed_tokens), generation_config.json
(forced ids, language/task tables, suppress lists), preprocessor_config.json
(WhisperFeatureExtractor's own save_pretrained), tokenizer.json + tokenizer_config.json.
The tokenizer is a small byte-level BPE trained here, followed, as in Whisper's
vocabulary, by Whisper's special tokens (<|endoftext|>, <|startoftranscript|>, language
tokens, <|translate|>, <|transcribe|>, ..., <|notimestamps|>).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.checkpoints import CORPUS

LANGUAGES = ("en", "zh", "de", "es", "ru", "ko", "fr", "ja")
SPECIALS = (
    ["<|endoftext|>", "<|startoftranscript|>"]
    + [f"<|{lang}|>" for lang in LANGUAGES]
    + ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>"]
)


def make_whisper_tokenizer(path: Path, bpe_vocab: int = 320) -> dict[str, int]:
    """Byte-level BPE trained on CORPUS, then Whisper's specials appended; returns their ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=bpe_vocab, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "model_max_length": 1024,
    }))
    return {s: tok.token_to_id(s) for s in SPECIALS}


def make_whisper_checkpoint(path: Path, seed: int = 0, max_target_positions: int = 64, suppress: bool = True,
                            **overrides) -> Path:
    """Save a tiny random Whisper (d_model 64, 2 + 2 layers, 4 heads, 80 mel bins, 1500
    encoder frames) with its generation config, feature extractor and tokenizer. Weights
    are drawn with std 0.5 (transformers' default 0.02 makes a model that repeats one
    token whatever the audio, which would prove little).

    `suppress=True` writes suppress_tokens / begin_suppress_tokens as real checkpoints have
    them (a few ordinary tokens always, <|endoftext|> and a space-like token at the start)."""
    import torch
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    ids = make_whisper_tokenizer(path)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size()
    eot, sot = ids["<|endoftext|>"], ids["<|startoftranscript|>"]
    suppress_tokens = [1, 2, 3, 7, 11] if suppress else None
    begin_suppress = [220 % eot, eot] if suppress else None
    cfg = dict(vocab_size=vocab, num_mel_bins=80, encoder_layers=2, encoder_attention_heads=4, decoder_layers=2,
               decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, d_model=64,
               max_source_positions=1500, max_target_positions=max_target_positions, decoder_start_token_id=sot,
               pad_token_id=eot, bos_token_id=eot, eos_token_id=eot, init_std=0.5,
               suppress_tokens=suppress_tokens, begin_suppress_tokens=begin_suppress, tie_word_embeddings=True)
    cfg.update(overrides)
    config = transformers.WhisperConfig(**cfg)
    torch.manual_seed(seed)
    model = transformers.WhisperForConditionalGeneration(config).eval()
    with torch.no_grad():  # random biases and LayerNorm affines, so those paths are exercised
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.2)
            elif "layer_norm.weight" in name:
                param.normal_(1.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    gen = {
        "decoder_start_token_id": sot, "eos_token_id": eot, "pad_token_id": eot, "bos_token_id": eot,
        "max_length": max_target_positions, "is_multilingual": True,
        "lang_to_id": {f"<|{lang}|>": ids[f"<|{lang}|>"] for lang in LANGUAGES},
        "task_to_id": {"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]},
        "no_timestamps_token_id": ids["<|notimestamps|>"], "prev_sot_token_id": ids["<|startofprev|>"],
        "forced_decoder_ids": [[1, None], [2, ids["<|transcribe|>"]]], "return_timestamps": False,
        "suppress_tokens": suppress_tokens, "begin_suppress_tokens": begin_suppress,
    }
    (path / "generation_config.json").write_text(json.dumps(gen, indent=1))
    transformers.WhisperFeatureExtractor(feature_size=cfg["num_mel_bins"]).save_pretrained(path)
    return path


def sine_sweep(seconds: float, sr: int = 16000, f0: float = 200.0, f1: float = 4000.0, seed: int = 0) -> np.ndarray:
    """A logarithmic sine sweep plus a little noise: a deterministic, speech-band test clip."""
    t = np.arange(int(seconds * sr)) / sr
    k = np.log(f1 / f0) / max(seconds, 1e-3)
    sweep = np.sin(2 * np.pi * f0 * (np.exp(k * t) - 1) / k)
    noise = np.random.default_rng(seed).standard_normal(t.size) * 0.05
    return (0.5 * sweep + noise).astype(np.float32)


def wav_bytes(samples: np.ndarray, sr: int = 16000, fmt: str = "WAV", subtype: str | None = None) -> bytes:
    """Encode samples ([n] or [n, channels]) as a WAV/FLAC file in memory."""
    import io

    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, samples, sr, format=fmt, subtype=subtype)
    return buf.getvalue()


@pytest.fixture(scope="session")
def whisper_ckpt(tmp_path_factory) -> Path:
    """A tiny Whisper folder (max_target_positions 64), made once per session; test
    modules import this fixture."""
    return make_whisper_checkpoint(tmp_path_factory.mktemp("whisper") / "tiny-whisper")
