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


def make_orpheus_tokenizer(path: Path, codebook_size: int = 64) -> None:
    """tests.checkpoints' byte-level BPE plus Orpheus' added tokens; like Llama 3's tokenizer it
    writes <|begin_of_text|> before the text, and its eos is end_of_speech (<custom_token_2>)."""
    from tokenizers import Tokenizer, processors

    make_tokenizer(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens(orpheus_tokens(codebook_size))
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B",
                                                       special_tokens=[("<|begin_of_text|>", bos)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
        "eos_token": "<custom_token_2>", "pad_token": "<|endoftext|>", "model_max_length": 4096,
    }))


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
