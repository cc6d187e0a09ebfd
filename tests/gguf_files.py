"""GGUF files written from the small random HF checkpoints of `tests.checkpoints`, the way
llama.cpp's `convert_hf_to_gguf.py --outtype f32` writes them (gguf-py's `GGUFWriter`,
`TensorNameMap` and `SpecialVocab`; q/k rows permuted for the `llama` architecture only)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np

# Meta's Llama 3 tokenizer.json split regex, verbatim (spelled here, not imported from the
# code under test, so a typo there shows up as different token ids).
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_ARCHS = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3,
          "gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3": gguf.MODEL_ARCH.GEMMA3, "phi3": gguf.MODEL_ARCH.PHI3}
#: what llama.cpp reads for Gemma 3 and does not find in the file (its fixed values):
#: checkpoints written as GGUF files of these archs are made with them (`GGUF_GEMMA`)
GGUF_GEMMA3_PATTERN = 6


def gguf_checkpoint_overrides(arch: str, n_layers: int = 6) -> dict[str, Any]:
    """`make_checkpoint` overrides that make an HF checkpoint what llama.cpp assumes of a
    GGUF file of `arch` (whose metadata carries no query scale, layer pattern or local
    RoPE base): Gemma's query scale 1 / sqrt(head_dim), Gemma 3's five-of-six sliding layers
    with local base 10000 and no scaling; Qwen3-MoE's renormalized top-k weights."""
    if arch == "gemma2":
        return {"query_pre_attn_scalar": 16, "num_hidden_layers": n_layers}
    if arch == "gemma3":
        types = ["full_attention" if (i + 1) % GGUF_GEMMA3_PATTERN == 0 else "sliding_attention"
                 for i in range(n_layers)]
        return {"query_pre_attn_scalar": 16, "num_hidden_layers": n_layers, "layer_types": types,
                "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}}
    if arch in ("qwen3moe", "qwen3_moe"):  # llama.cpp's qwen3moe always renormalizes the top-k weights
        return {"norm_topk_prob": True}
    return {}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (q with n_head, k with n_kv_head): each head's two
    rotary halves interleaved, for its GPT-J-style RoPE."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_theta(cfg: dict) -> float:
    # transformers 5 writes rope_parameters (per layer type for Gemma 3); classic configs a
    # top-level rope_theta.
    params = cfg.get("rope_parameters") or {}
    params = params.get("full_attention", params)
    return float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(cfg: dict) -> dict | None:
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    scaling = scaling.get("full_attention", scaling)
    kind = scaling.get("rope_type") or scaling.get("type")
    return None if kind in (None, "default") else scaling


def _bpe_vocab(tok, size: int) -> tuple[list[str], list[int]]:
    """`_set_vocab_gpt2`'s tokens and types, in id order: added tokens CONTROL when special,
    else USER_DEFINED; ids the tokenizer lacks up to `size` `[PADn]`, UNUSED."""
    reverse = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    added = tok.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.NORMAL if i not in added else
                         gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
    return tokens, types


def _finish(writer: gguf.GGUFWriter) -> None:
    """Write the header, the metadata and the tensors, and close the file."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_gguf(hf_ckpt_dir: Path, out_path: Path, arch: str, pre: str, *,
               rope_scaling: dict[str, Any] | None = None, rope_freqs: bool = False,
               general_architecture: str | None = None, qtypes: dict[str, str] | None = None,
               tokenizer_model: str = "gpt2") -> Path:
    """Write `hf_ckpt_dir` (a `make_checkpoint` folder) as an all-F32 GGUF of `arch`
    (llama | qwen2 | qwen3) whose `tokenizer.ggml.pre` is `pre`.

    `rope_scaling` (HF form, e.g. {"rope_type": "yarn", "factor": 4.0,
    "original_max_position_embeddings": 128}) overrides the checkpoint's; `rope_freqs` adds
    the `rope_freqs.weight` tensor llama.cpp writes for Llama 3.1-style scaling;
    `general_architecture` overrides the architecture name written (to test refusals), and
    `tokenizer_model` the `tokenizer.ggml.model` written (the vocabulary stays byte-level BPE).
    `qtypes`: GGUF tensor-name suffix (e.g. "ffn_down.weight", "token_embd.weight") -> the
    type those matrices are written in (one the `gguf` package quantizes: Q4_0, Q4_1, Q5_0,
    Q5_1, Q8_0); every other tensor stays F32.
    """
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer

    hf_ckpt_dir, out_path = Path(hf_ckpt_dir), Path(out_path)
    cfg = json.loads((hf_ckpt_dir / "config.json").read_text())
    model_arch = _ARCHS[arch]
    n_layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    n_head = cfg["num_attention_heads"]
    n_kv_head = cfg.get("num_key_value_heads") or n_head
    head_dim = cfg.get("head_dim") or hidden // n_head

    writer = gguf.GGUFWriter(str(out_path), general_architecture or gguf.MODEL_ARCH_NAMES[model_arch])
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(hf_ckpt_dir.name)
    # TextModel.set_gguf_parameters
    writer.add_block_count(n_layers)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv_head)
    writer.add_rope_freq_base(_rope_theta(cfg))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if cfg.get("head_dim") is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "llama":  # LlamaModel.set_gguf_parameters
        writer.add_vocab_size(cfg["vocab_size"])
        writer.add_rope_dimension_count(head_dim)
    if arch in ("gemma2", "gemma3"):  # Gemma2Model / Gemma3Model.set_gguf_parameters (head sizes above)
        writer.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if arch == "phi3":  # Phi3MiniModel.set_gguf_parameters
        writer.add_rope_dimension_count(int(head_dim * cfg.get("partial_rotary_factor", 1.0)))
        if cfg.get("sliding_window"):
            writer.add_sliding_window(cfg["sliding_window"])
    scaling = rope_scaling if rope_scaling is not None else _rope_scaling(cfg)
    if scaling:
        kind = scaling.get("rope_type") or scaling.get("type")
        if kind == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(scaling["factor"])
        elif kind == "yarn":
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(scaling["factor"])
            writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        else:
            raise ValueError(f"rope scaling {kind!r} is not written by this helper")

    # TextModel._set_vocab_gpt2 / get_vocab_base, from tokenizer.json
    tokens, types = _bpe_vocab(Tokenizer.from_file(str(hf_ckpt_dir / "tokenizer.json")), cfg["vocab_size"])
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(hf_ckpt_dir, load_merges=True, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)

    # ModelBase.prepare_tensors / LlamaModel.modify_tensors
    tmap = gguf.get_tensor_name_map(model_arch, n_layers)
    state = {}
    for f in sorted(hf_ckpt_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    for name, w in state.items():
        w = np.ascontiguousarray(w, dtype=np.float32)
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            w = w + np.float32(1.0)  # Gemma2Model.modify_tensors: llama.cpp multiplies by (1 + w)
        if arch in ("gemma2", "gemma3") and name == "lm_head.weight":
            continue  # tied to the embedding; the converter skips it
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _permute(w, n_head)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _permute(w, n_kv_head)
        new_name = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        if new_name is None:
            raise KeyError(f"no GGUF name for {name!r}")
        qtype = next((t for suffix, t in (qtypes or {}).items() if new_name.endswith(suffix)), None)
        if qtype is not None and w.ndim == 2:
            kind = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(new_name, gguf.quants.quantize(w, kind), raw_dtype=kind)
            continue
        writer.add_tensor(new_name, np.ascontiguousarray(w))
    if rope_freqs:  # LlamaModel.generate_extra_tensors, from the checkpoint's llama3 rope scaling
        writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight",
                          llama3_rope_factors(_rope_scaling(cfg) or {}, _rope_theta(cfg), head_dim))

    _finish(writer)
    return out_path


def llama3_rope_factors(scaling: dict, theta: float, dim: int) -> np.ndarray:
    """llama.cpp's converter's `rope_freqs` for Llama 3.1-style scaling, as it computes them
    (factor 8, low 1, high 4, original context 8192 where the config does not say)."""
    import math

    factor = scaling.get("factor", 8.0)
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old / low, old / high
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def llama3_tokenizer_variant(ckpt_dir: Path, bos_token: str = "<|im_start|>") -> Path:
    """Rewrite `ckpt_dir`'s tokenizer the way Meta's Llama 3 tokenizer.json is built:
    Split(Llama 3 regex, isolated) + ByteLevel(use_regex=False), `ignore_merges`, and a BOS
    prepended by a TemplateProcessing post-processor (`bos_token` also set in
    tokenizer_config.json and config.json). Same vocab and merges; HF's tokenizer from the
    rewritten tokenizer.json is the reference for pre "llama-bpe". The BOS is not the pad
    token (id 0): `hf_greedy` passes pad_token_id=0 and transformers would mask it out."""
    ckpt_dir = Path(ckpt_dir)
    tok_path = ckpt_dir / "tokenizer.json"
    tj = json.loads(tok_path.read_text())
    bos_id = next(t["id"] for t in tj["added_tokens"] if t["content"] == bos_token)
    tj["normalizer"] = None
    tj["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
    ]}
    tj["model"]["ignore_merges"] = True
    tj["post_processor"] = {"type": "Sequence", "processors": [
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        {"type": "TemplateProcessing",
         "single": [{"SpecialToken": {"id": bos_token, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
         "pair": [{"SpecialToken": {"id": bos_token, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                  {"SpecialToken": {"id": bos_token, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
         "special_tokens": {bos_token: {"id": bos_token, "ids": [bos_id], "tokens": [bos_token]}}},
    ]}
    tok_path.write_text(json.dumps(tj, ensure_ascii=False))
    for name, key, value in (("tokenizer_config.json", "bos_token", bos_token),
                             ("config.json", "bos_token_id", bos_id)):
        path = ckpt_dir / name
        data = json.loads(path.read_text())
        data[key] = value
        path.write_text(json.dumps(data))
    return ckpt_dir


def write_spm_gguf(sp_model: Path, out_path: Path, *, user_defined: tuple[str, ...] = (),
                   add_space_prefix: bool | None = None, add_bos: bool | None = True,
                   add_eos: bool | None = False, pre: str | None = "default") -> Path:
    """A tokenizer-only GGUF (architecture `llama`, no tensors) of the SentencePiece model
    `sp_model`, written as llama.cpp's `_set_vocab_sentencepiece` / `_create_vocab_sentencepiece`
    write one: the pieces, their scores and types (UNKNOWN, CONTROL, UNUSED, BYTE, else
    NORMAL), model "llama", pre "default", the special ids and add_bos/add_eos (None: the
    key left out). `user_defined` pieces are the ones an HF checkpoint lists in its
    added_tokens_decoder as not special: USER_DEFINED, their U+2581 written as spaces (the
    converter's "pre-normalize user-defined spaces"). `add_space_prefix` False is what
    the Gemma converter writes (None: no key, llama.cpp's default on)."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        piece, kind = sp.id_to_piece(i), gguf.TokenType.NORMAL
        if sp.is_unknown(i):
            kind = gguf.TokenType.UNKNOWN
        elif sp.is_control(i):
            kind = gguf.TokenType.CONTROL
        elif sp.is_unused(i):
            kind = gguf.TokenType.UNUSED
        elif sp.is_byte(i):
            kind = gguf.TokenType.BYTE
        elif piece in user_defined:
            kind, piece = gguf.TokenType.USER_DEFINED, piece.replace("\u2581", " ")
        tokens.append(piece)
        scores.append(sp.get_score(i))
        types.append(kind)
    writer = gguf.GGUFWriter(str(out_path), "llama")
    writer.add_tokenizer_model("llama")
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(sp.unk_id())
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    if add_eos is not None:
        writer.add_add_eos_token(add_eos)
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    _finish(writer)
    return out_path


def write_bpe_gguf(tokenizer_json: Path, out_path: Path, pre: str | None, *, add_bos: bool | None = None) -> Path:
    """A tokenizer-only GGUF (architecture `llama`, no tensors) of the byte-level BPE
    `tokenizer.json`, written as `_set_vocab_gpt2` writes one: tokens in id order (added
    ones CONTROL when special, else USER_DEFINED), the merges, model "gpt2", `pre` (None:
    the key left out), BOS/EOS the first and second added tokens."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    added = tok.get_added_tokens_decoder()
    tokens, types = _bpe_vocab(tok, tok.get_vocab_size(with_added_tokens=True))
    merges = json.loads(tok.to_str())["model"]["merges"]
    writer = gguf.GGUFWriter(str(out_path), "llama")
    writer.add_tokenizer_model("gpt2")
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    first, second = sorted(added)[:2]
    writer.add_bos_token_id(first)
    writer.add_eos_token_id(second)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    _finish(writer)
    return out_path


#: byte offsets of the float16 fields (scales, mins) within a block of each type the
#: quantized path keeps (every other byte of these types is valid whatever its value)
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
              "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,)}


def random_blocks(qtype: str, n: int, k: int, rng: np.random.Generator,
                  scales: tuple[float, float] = (1e-3, 1e-2)) -> np.ndarray:
    """[n, bytes per row] of valid random `qtype` blocks (a key of F16_FIELDS) for an
    n x k matrix: random bytes, each float16 field a random sign times a magnitude uniform
    in `scales` (random bytes are a valid block of these types once those are finite)."""
    size, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    raw = rng.integers(0, 256, (n, k // size, nbytes), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        value = rng.uniform(*scales, (n, k // size)) * rng.choice([-1, 1], (n, k // size))
        raw[:, :, off:off + 2] = value.astype(np.float16).view(np.uint8).reshape(n, k // size, 2)
    return raw.reshape(n, -1)


def blocks_like(w: np.ndarray, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """Random valid `qtype` blocks for the float matrix w [n, k], their float16 fields scaled
    so that the dequantized matrix has w's RMS: a matrix of the right size, not w's values
    (for types gguf-py cannot quantize)."""
    n, k = w.shape
    raw = random_blocks(qtype, n, k, rng, (0.5, 1.0))
    kind = gguf.GGMLQuantizationType[qtype]
    rms = float(np.sqrt(np.mean(np.square(gguf.quants.dequantize(raw, kind), dtype=np.float64))))
    factor = float(np.sqrt(np.mean(np.square(w, dtype=np.float64)))) / max(rms, 1e-30)
    size, nbytes = gguf.GGML_QUANT_SIZES[kind]
    blocks = raw.reshape(n, k // size, nbytes)
    for off in F16_FIELDS[qtype]:
        field = blocks[:, :, off:off + 2].copy().view(np.float16).astype(np.float32) * factor
        blocks[:, :, off:off + 2] = field.astype(np.float16).view(np.uint8)
    return blocks.reshape(n, -1)


def write_gguf_mix(hf_ckpt_dir: Path, out_path: Path, arch: str, pre: str, qtypes: dict[str, str],
                   seed: int = 0, **kwargs: Any) -> Path:
    """`write_gguf` whose `qtypes` may also name the types gguf-py cannot quantize (Q4_K,
    Q5_K, Q6_K, IQ4_NL, IQ4_XS: what llama.cpp's `_K_M`, `_K_S` and `IQ4_*` files mix):
    those matrices are written as `blocks_like` makes them (random values of the float
    matrix's RMS), the others as `write_gguf` quantizes them. A suffix such as
    "blk.0.ffn_down.weight" placed before "ffn_down.weight" gives one layer its own type (the
    first suffix that matches wins), as llama.cpp's mixes do. `gguf.quants.quantize` is
    wrapped while the file is written."""
    real = gguf.quants.quantize
    rng = np.random.default_rng(seed)

    def quantize(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
        try:
            return real(data, qtype)
        except NotImplementedError:
            return blocks_like(np.asarray(data, dtype=np.float32), qtype.name, rng)

    gguf.quants.quantize = quantize
    try:
        return write_gguf(hf_ckpt_dir, out_path, arch, pre, qtypes=qtypes, **kwargs)
    finally:
        gguf.quants.quantize = real
