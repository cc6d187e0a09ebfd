"""A GGUF model with quantized matrices: `--dtype auto` keeps them quantized (`QuantLinear`,
`QuantEmbedding`, the tied head on the quantized embedding), `--dtype float32` dequantizes
as before; the quantized path's (and a bfloat16 KV pool's) perplexity stays within 1% of the
float32 path's, on tiny checkpoints and on the default model (issue 19's quality rule; the
whole text is `python -m bench.perplexity`)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from bench.perplexity import load, perplexity, text_ids
from services.gpu_worker.gguf_weights import load_gguf_weights
from services.gpu_worker.layers import quant
from services.gpu_worker.layers.quant import QuantEmbedding, QuantLinear, QuantParts
from tests.checkpoints import make_checkpoint
from tests.gguf_files import write_gguf

pytestmark = [pytest.mark.kernels, pytest.mark.skipif(not quant.available(), reason="no quantized GEMM kernel")]

#: a mix: q/k/v in different forms (not fused), every type the gguf package can write
QTYPES = {"token_embd.weight": "Q8_0", "output.weight": "Q8_0", "attn_q.weight": "Q4_0", "attn_k.weight": "Q4_1",
          "attn_v.weight": "Q5_1", "attn_output.weight": "Q5_0", "ffn_gate.weight": "Q4_1",
          "ffn_up.weight": "Q4_1", "ffn_down.weight": "Q8_0"}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def quantized_gguf(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"q-{request.param}")
    ckpt = make_checkpoint(root / "ckpt", request.param)
    return write_gguf(ckpt, root / "model.gguf", request.param, "gpt2" if request.param == "llama" else "qwen2",
                      qtypes=QTYPES)


def test_auto_keeps_gguf_matrices_quantized_and_float32_dequantizes(quantized_gguf):
    model, _, _ = load(str(quantized_gguf), "auto", "float32")
    kinds = [type(m) for m in model.modules()]
    assert QuantLinear in kinds and not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    assert isinstance(model.head, QuantLinear)
    layer = model.model.layers[0]
    qkv = layer.self_attn.qkv_proj  # Q4_0 / Q4_1 / Q5_1: forms 4 and 5, the GEMMs apart in one module
    assert isinstance(qkv, QuantParts) and [p.form & ~quant.FLAGS for p in qkv.layers] == [4, 4, quant.Q5]
    assert isinstance(layer.mlp.gate_up_proj, QuantLinear)  # both Q4_1: one GEMM
    # each kept matrix is gguf's dequantization, bit for bit
    _, arrays = load_gguf_weights(quantized_gguf, progress=False)
    assert torch.equal(layer.mlp.down_proj.weight, torch.from_numpy(arrays["model.layers.0.mlp.down_proj.weight"]))
    assert torch.equal(model.model.embed_tokens.weight, torch.from_numpy(arrays["model.embed_tokens.weight"]))
    plain, _, _ = load(str(quantized_gguf), "float32", "float32")
    assert not any(isinstance(m, (QuantLinear, QuantEmbedding)) for m in plain.modules())


def test_quantized_and_bf16_kv_perplexity_within_one_percent(quantized_gguf):
    ids = list(np.random.default_rng(0).integers(0, 200, 300))
    base = perplexity(*load(str(quantized_gguf), "float32", "float32")[:2], ids)
    for kv in ("float32", "bfloat16"):
        model, spec, kvd = load(str(quantized_gguf), "auto", kv)
        assert abs(perplexity(model, spec, ids, kvd) / base - 1) < 0.01, kv


def test_default_model_perplexity_within_one_percent():
    """The first 384 tokens of the shipped public-domain text (bench/perplexity.py runs all)."""
    from shared.model_source import ModelSource

    ids = text_ids(ModelSource("").tokenizer.tokenizer, 384)
    base = perplexity(*load("", "float32", "float32")[:2], ids)
    assert base < 60  # a model that reads English
    model, spec, _ = load("", "auto", "float32")
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) >= 30 * 3
    for kv in (torch.float32, torch.bfloat16):  # the same model over float32 and bfloat16 pages
        assert abs(perplexity(model, spec, ids, kv) / base - 1) < 0.01, kv
    # prompt rows on a bfloat16 copy of each layer's weights (--prefill-dtype bfloat16)
    model, spec, kvd = load("", "auto", "bfloat16", "bfloat16")
    widened = [m for m in model.modules() if isinstance(m, QuantLinear) and m.wide is not None]
    assert len(widened) == len(model.model.layers) * 4  # q, k, v fused (Q4_1 alike), o, gate/up, down
    assert model.head.wide is None and model.model.embed_tokens.table.wide is None  # sampled rows only
    assert abs(perplexity(model, spec, ids, kvd) / base - 1) < 0.01
    # prompt rows rounded to one byte a value (--prefill-dtype int8, llama.cpp's rounding)
    model, spec, kvd = load("", "auto", "bfloat16", "int8")
    assert {m.prompt_bytes for m in model.model.layers.modules() if isinstance(m, QuantLinear)} == {1}
    assert abs(perplexity(model, spec, ids, kvd) / base - 1) < 0.01


def test_gguf_types_the_kernel_does_not_take_are_dequantized():
    assert gguf.GGMLQuantizationType.Q2_K.name not in quant.KEPT_TYPES


def test_dtype_auto_on_a_checkpoint_keeps_its_dtype_where_native(tmp_path):
    """`--dtype auto` on safetensors: a bfloat16 checkpoint computes in bfloat16 on a CPU with
    bf16 instructions (else float32); float32 is kept; an explicit dtype wins."""
    import json

    from services.gpu_worker.weights import cpu_computes_bf16, weight_dtype
    from shared.model_source import ModelSource

    ckpt = make_checkpoint(tmp_path / "ckpt", "llama")
    assert weight_dtype("auto", ModelSource(str(ckpt)), "cpu") == (torch.float32, False)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    want = torch.bfloat16 if cpu_computes_bf16() else torch.float32
    assert weight_dtype("auto", ModelSource(str(ckpt)), "cpu") == (want, False)
    assert weight_dtype("float32", ModelSource(str(ckpt)), "cpu") == (torch.float32, False)
    # the bfloat16 compute path (and bfloat16 pages) stays within 1% of float32's perplexity
    ids = list(np.random.default_rng(1).integers(0, 200, 200))
    base = perplexity(*load(str(ckpt), "float32", "float32")[:2], ids)
    model, spec, kvd = load(str(ckpt), "bfloat16", "bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
    assert abs(perplexity(model, spec, ids, kvd) / base - 1) < 0.01


def test_float32_gguf_is_transformers_reading_the_same_file():
    """`--dtype float32` dequantizes the default Q4_1 GGUF as transformers' own GGUF loader
    does: the same next token at every position of 48 tokens of text, logits within 1e-3."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from shared.gguf_source import find_default_gguf, gguf_config
    from shared.model_source import ModelSource

    # transformers' own GGUF reading (its from_pretrained(gguf_file=) wants accelerate)
    path = str(find_default_gguf())
    config = transformers.LlamaConfig(**gguf_config(path))  # the model's shape; the weights are transformers'
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = load_gguf_checkpoint(path, return_tensors=True, model_to_load=hf)["tensors"]
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    hf.tie_weights()
    ids = text_ids(ModelSource("").tokenizer.tokenizer, 48)
    model, spec, _ = load("", "float32", "float32")
    ours = _logits(model, spec, ids)
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids])).logits[0]
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    assert float((ours - theirs).abs().max()) < 1e-3


def _logits(model, spec, ids: list[int]) -> torch.Tensor:
    """Every row's logits for `ids` as one prefill through the paged path."""
    from services.gpu_worker.attention import build_metadata
    from services.gpu_worker.kv_memory import kv_cache

    pool = next(iter(spec.paged_pools(len(ids) // 16 + 2).values()))
    caches = kv_cache(pool.num_layers, pool.num_pages, 16, pool.kv_heads, pool.head_dim, torch.float32,
                      torch.device("cpu"))
    meta = build_metadata([(list(range(pool.num_pages)), 0, 0, len(ids), False)], 16)
    with torch.inference_mode():
        return model(torch.tensor(ids), torch.arange(len(ids)), caches, [meta] * len(caches), torch.arange(len(ids)))
