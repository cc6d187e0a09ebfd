"""Small random-weight checkpoints made with transformers, and a byte-level BPE tokenizer
trained here with `tokenizers`: the exact-token reference for parity tests (no download)."""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? Paris is the capital of France.",
    "Serving engines batch requests and page their KV cache.",
    "def add(a, b):\n    return a + b\n",
    "Numbers like 12345 and 3.14159 appear in text; so do emoji 🎉 and 中文字符.",
    "Hello world! Hello again, world. Goodbye, world.",
] * 20

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
                 r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


def make_tokenizer(path: Path, vocab_size: int = 512, family: str = "llama",
                   extra_specials: tuple[str, ...] = ()) -> None:
    """Byte-level BPE trained on CORPUS. Qwen2's pipeline (NFC + its split regex) for qwen
    families, because transformers' Qwen2Tokenizer imposes it whatever tokenizer.json says.
    `extra_specials` take the ids right after SPECIALS' (small ids, as some checkpoints have)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if family.startswith("qwen"):
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS + list(extra_specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "bos_token": None,
        "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE, "model_max_length": 4096,
    }))


#: transformers config class and model class of each family, and what the family sets
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(tie_word_embeddings=False, sliding_window=8, head_dim=16)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False, head_dim=32)),
    # Gemma: one sliding (window 8, shorter than prompt + output) and one global layer;
    # soft-capping low enough that it changes which keys win
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                                                         attn_logit_softcapping=2.0, final_logit_softcapping=5.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                                                             layer_types=["sliding_attention", "full_attention"],
                                                             rope_parameters={
                                                                 "sliding_attention": {"rope_type": "default",
                                                                                       "rope_theta": 10000.0},
                                                                 "full_attention": {"rope_type": "linear",
                                                                                    "factor": 2.0,
                                                                                    "rope_theta": 1000000.0}})),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(tie_word_embeddings=False, sliding_window=12,
                                                   original_max_position_embeddings=512)),
    # Qwen3.5: three Gated DeltaNet layers and one gated full-attention layer, grouped
    # value heads (4 v heads over 2 k heads) and unequal key / value head dims
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        tie_word_embeddings=False, num_hidden_layers=4, head_dim=16, linear_key_head_dim=8,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)),
    # Qwen3.5's hybrid with a mixture of experts in every layer (8 of width 32, 2 a token)
    # and a shared expert of width 48 behind its sigmoid gate
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        tie_word_embeddings=False, num_hidden_layers=4, head_dim=16, linear_key_head_dim=8,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2)),
    # Qwen3-Next: the same, its linear projections fused per key head; layer 1 dense
    # (mlp_only_layers), top-k weights not renormalized
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        tie_word_embeddings=False, num_hidden_layers=4, head_dim=16, linear_key_head_dim=8,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1],
        norm_topk_prob=False)),
    # a mixture of experts: 8 experts of width 32, 2 a token (tests override the shape)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(tie_word_embeddings=False, head_dim=32,
                                                                moe_intermediate_size=32, num_experts=8,
                                                                num_experts_per_tok=2)),
    # gpt-oss: sliding (window 8) and full layers alternating, attention sinks, biases,
    # 8 experts of width 32, 2 a token, YaRN over a 64-position pretraining context
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        tie_word_embeddings=False, head_dim=16, sliding_window=8, intermediate_size=32, num_local_experts=8,
        num_experts_per_tok=2, rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                                                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                "original_max_position_embeddings": 64})),
    # Mixtral: every layer sparse, 8 experts of intermediate_size 32, 2 a token, renormalized;
    # no sliding window (as Mixtral-8x7B's config: null)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(tie_word_embeddings=False, head_dim=32,
                                                            intermediate_size=32, num_local_experts=8,
                                                            num_experts_per_tok=2, sliding_window=None)),
}


def make_checkpoint(path: Path, family: str = "llama", seed: int = 0, specials: tuple[str, ...] = (),
                    **overrides) -> Path:
    """Save a tiny random checkpoint of `family` (a key of FAMILIES) with its tokenizer,
    in the form this transformers version writes (rope_parameters on transformers 5).
    `specials`: more special tokens in the tokenizer (ids after SPECIALS')."""
    import torch
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    make_tokenizer(path, family=family, extra_specials=specials)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size()
    eos = Tokenizer.from_file(str(path / "tokenizer.json")).token_to_id("<|im_end|>")
    cfg_name, model_name, family_kw = FAMILIES[family]
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, eos_token_id=eos, bos_token_id=None, pad_token_id=0,
                  initializer_range=0.2)
    common.update(family_kw)
    common.update(overrides)
    cfg = getattr(transformers, cfg_name)(**common)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():  # random biases (HF inits them to zero), so the bias path is exercised
        for name, param in model.named_parameters():
            if name.endswith(".bias") or (family == "gpt_oss" and name.endswith("_bias")):  # its experts' biases
                param.normal_(0.0, 0.2)
            elif family.startswith(("gemma", "qwen3_5", "qwen3_next")) and name.endswith("norm.weight"):
                param.normal_(0.0, 0.3)  # (1 + w) norms: HF inits w to 0, which hides the offset
    model.save_pretrained(path, safe_serialization=True)
    return path


def to_classic_config(src: Path, dst: Path) -> Path:
    """A copy of checkpoint `src` whose config.json is in the form transformers 4.x wrote:
    top-level `rope_theta` and `rope_scaling` (Gemma 3: `rope_local_base_freq`, Phi-3: a
    top-level `original_max_position_embeddings`), no `rope_parameters`, no `layer_types`
    where 4.x derived them. The weights are the same files."""
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    params = cfg.pop("rope_parameters", None) or {}
    if "full_attention" in params:  # Gemma 3: one dict per layer type
        full, local = dict(params["full_attention"]), dict(params["sliding_attention"])
        cfg["rope_local_base_freq"] = local.pop("rope_theta")
        params = full
    cfg["rope_theta"] = params.pop("rope_theta", 10000.0)
    params.pop("partial_rotary_factor", None)
    kind = params.get("rope_type", "default")
    cfg["rope_scaling"] = None if kind == "default" else {**params, "type": kind}
    if cfg.get("model_type") == "gemma3_text":
        types = cfg.pop("layer_types")
        pattern = types.index("full_attention") + 1
        assert all((t == "full_attention") == ((i + 1) % pattern == 0) for i, t in enumerate(types))
        cfg["sliding_window_pattern"] = pattern
        cfg.pop("_sliding_window_pattern", None)
    elif cfg.get("model_type") in ("gemma2", "mistral", "phi3", "llama", "qwen2", "qwen3"):
        # 4.x derived them (Qwen: from use_sliding_window and max_window_layers)
        cfg.pop("layer_types", None)
    cfg["transformers_version"] = "4.46.0"
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def with_architecture(src: Path, dst: Path, architecture: str) -> Path:
    """A copy of checkpoint `src` that names another (plugin) architecture."""
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = [architecture]
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst
