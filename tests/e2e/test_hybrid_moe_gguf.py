"""Qwen3.5-MoE and Qwen3-Next GGUF files as llama.cpp's OWN converter writes them
(architectures ``qwen35moe`` and ``qwen3next``: `tests/llama_converter.py`), served by
`mstar serve file.gguf` through the real services, from tiny random checkpoints with
SmolLM2's vocabulary and a multi-token prediction layer with experts (converted into
``blk.N.nextn``, not run), in test_hybrid_gguf's shape (2 key heads under 4 value heads):

- f32: greedy tokens equal transformers' on the checkpoint, prompt ids its tokenizer's;
- Q8_0, served quantized (the C kernels on the file's blocks, the experts' too, as for
  ``qwen3moe``): greedy tokens equal transformers' on a folder of the file's dequantized
  weights (put back in the checkpoint's own layout: experts fused, Qwen3-Next's
  projections fused per key head again).

Where the checkpoints differ from llama.cpp's graph, they are made as llama.cpp computes:
Qwen3-Next with every layer sparse (the converter cannot map a dense MLP) and its top-k
weights renormalized (llama.cpp's qwen3next always does).

transformers tokenizes a ``qwen3_5_moe_text`` folder with Qwen3.5's own split whatever its
tokenizer files say, a vocabulary whose hash the converter does not know for SmolLM2's
tokens: it is converted with the converter's pre-tokenizer lookup answering "qwen35" (the
name of that split) where its table has no entry, everything else the converter's own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest

from tests.checkpoints import make_checkpoint
from tests.e2e.test_hybrid_gguf import SHAPE, _served_equal_transformers
from tests.llama_converter import converter, smollm2_vocabulary


def _moe_converter() -> bool:
    """The converter is there and writes both architectures."""
    script = converter()
    if script is None:
        return False
    text = (script.parent / "conversion" / "qwen.py").read_text()
    return "Qwen3_5MoeForCausalLM" in text and "Qwen3NextForCausalLM" in text


pytestmark = pytest.mark.skipif(not _moe_converter(), reason="llama.cpp's convert_hf_to_gguf.py with Qwen3.5-MoE "
                                "and Qwen3-Next is not available (scripts/fetch-llama-converter fetches it)")

#: family of tests.checkpoints.FAMILIES -> (GGUF architecture, overrides)
FAMILIES = {"qwen3_5_moe": ("qwen35moe", {}),
            "qwen3_next": ("qwen3next", dict(mlp_only_layers=[], norm_topk_prob=True))}

#: the converter, its pre-tokenizer lookup answering "qwen35" for a hash it does not know
#: (argv: the script, then its own arguments)
_RUN_CONVERTER = """
import runpy, sys
from pathlib import Path
script = Path(sys.argv[1])
sys.path[:0] = [str(script.parent / "gguf-py"), str(script.parent)]
from conversion import base
lookup = base.TextModel.get_vocab_base_pre
def named(self, tokenizer):
    try:
        return lookup(self, tokenizer)
    except NotImplementedError:
        return "qwen35"
base.TextModel.get_vocab_base_pre = named
sys.argv = [str(script), *sys.argv[2:]]
runpy.run_path(str(script), run_name="__main__")
"""


class Files(NamedTuple):
    arch: str
    ckpt: Path  # the HF checkpoint
    f32: Path  # the converter's f32 file of it
    q8: Path  # its Q8_0 file
    dequantized: Path  # an HF folder of the Q8_0 file's weights, dequantized


def _add_mtp_layer(ckpt: Path) -> None:
    """Random ``mtp.*`` weights of one layer whose MLP is the sparse block (router, experts,
    shared expert and its gate), as a released checkpoint has: transformers skips them, the
    converter writes them as ``blk.N.nextn``."""
    import torch
    from safetensors.torch import load_file, save_file

    cfg = json.loads((ckpt / "config.json").read_text())
    hidden, heads, kv, hd = (cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"))
    experts, width, shared = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
    layer = {"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
             "self_attn.q_proj.weight": (2 * heads * hd, hidden), "self_attn.k_proj.weight": (kv * hd, hidden),
             "self_attn.v_proj.weight": (kv * hd, hidden), "self_attn.o_proj.weight": (hidden, heads * hd),
             "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,), "mlp.gate.weight": (experts, hidden),
             "mlp.shared_expert_gate.weight": (1, hidden), "mlp.shared_expert.gate_proj.weight": (shared, hidden),
             "mlp.shared_expert.up_proj.weight": (shared, hidden),
             "mlp.shared_expert.down_proj.weight": (hidden, shared)}
    for e in range(experts):
        layer.update({f"mlp.experts.{e}.gate_proj.weight": (width, hidden),
                      f"mlp.experts.{e}.up_proj.weight": (width, hidden),
                      f"mlp.experts.{e}.down_proj.weight": (hidden, width)})
    shapes = {"fc.weight": (hidden, 2 * hidden), "pre_fc_norm_embedding.weight": (hidden,),
              "pre_fc_norm_hidden.weight": (hidden,), "norm.weight": (hidden,),
              **{f"layers.0.{k}": s for k, s in layer.items()}}
    gen = torch.Generator().manual_seed(7)
    state = load_file(str(ckpt / "model.safetensors"))
    state.update({f"mtp.{k}": torch.randn(s, generator=gen) * 0.2 for k, s in shapes.items()})
    save_file(state, str(ckpt / "model.safetensors"), metadata={"format": "pt"})


def _convert(ckpt: Path, outs: dict[str, Path]) -> None:
    """The converter for each out type at once (two processes)."""
    script = converter()
    assert script is not None
    env = {**os.environ, "PYTHONPATH": str(script.parent / "gguf-py")}
    env.pop("NO_LOCAL_GGUF", None)
    procs = {t: subprocess.Popen([sys.executable, "-c", _RUN_CONVERTER, str(script), str(ckpt), "--outtype", t,
                                  "--outfile", str(out)], env=env, cwd=script.parent, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT)
             for t, out in outs.items()}
    for t, proc in procs.items():
        log, _ = proc.communicate(timeout=300)
        if proc.returncode != 0 or not outs[t].is_file():
            raise RuntimeError(f"convert_hf_to_gguf.py --outtype {t} failed:\n{log.decode()[-3000:]}")


def _fused_projections(state: dict, cfg: dict) -> dict:
    """Qwen3.5's four linear-layer projections back into Qwen3-Next's in_proj_qkvz and
    in_proj_ba (per key head: q, k, v, z; b, a): `qwen3_next.split_projections` undone."""
    import torch

    nk, dk, dv = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    r = cfg["linear_num_value_heads"] // nk
    out = {}
    for name in [n for n in state if n.endswith(".linear_attn.in_proj_qkv.weight")]:
        prefix = name.removesuffix("in_proj_qkv.weight")
        qkv, z = state.pop(name), state.pop(prefix + "in_proj_z.weight")
        q, k, v = qkv.split([nk * dk, nk * dk, nk * r * dv])
        groups = [t.reshape(nk, -1, t.shape[-1]) for t in (q, k, v, z)]
        out[prefix + "in_proj_qkvz.weight"] = torch.cat(groups, dim=1).reshape(-1, qkv.shape[-1])
        b, a = (state.pop(prefix + f"in_proj_{p}.weight").reshape(nk, r, -1) for p in ("b", "a"))
        out[prefix + "in_proj_ba.weight"] = torch.cat((b, a), dim=1).reshape(-1, b.shape[-1])
    return {**state, **out}


def _dequantized_folder(ckpt: Path, gguf_path: Path, out: Path) -> Path:
    """The checkpoint's folder with the GGUF file's weights (dequantized), in the layout the
    checkpoint has: experts fused as transformers 5 keeps them, Qwen3-Next's projections
    fused per key head."""
    import torch
    from safetensors.torch import save_file

    from services.gpu_worker.gguf_weights import load_gguf_weights
    from services.gpu_worker.layers.moe import stack_experts

    shutil.copytree(ckpt, out)
    config, arrays = load_gguf_weights(gguf_path, progress=False)
    state = stack_experts({k: torch.from_numpy(np.asarray(v)) for k, v in arrays.items()}, config["num_experts"])
    if config["model_type"] == "qwen3_next":
        state = _fused_projections(state, config)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def files(request, tmp_path_factory) -> Files:
    from tokenizers import Tokenizer

    family = request.param
    arch, overrides = FAMILIES[family]
    root = tmp_path_factory.mktemp(f"{arch}-gguf")
    vocab = smollm2_vocabulary(root / "bpe")
    tok = Tokenizer.from_file(str(vocab / "tokenizer.json"))
    eos = tok.token_to_id(json.loads((vocab / "tokenizer_config.json").read_text())["eos_token"])
    ckpt = make_checkpoint(root / f"tiny-{arch}", family, vocab_size=tok.get_vocab_size(), eos_token_id=eos,
                           bos_token_id=None, pad_token_id=0, **SHAPE, **overrides)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (ckpt / name).unlink(missing_ok=True)
        shutil.copy(vocab / name, ckpt / name)
    _add_mtp_layer(ckpt)
    f32, q8 = root / f"tiny-{arch}-f32.gguf", root / f"tiny-{arch}-q8_0.gguf"
    _convert(ckpt, {"f32": f32, "q8_0": q8})
    return Files(arch, ckpt, f32, q8, _dequantized_folder(ckpt, q8, root / f"tiny-{arch}-q8_0-dequantized"))


def test_the_file_is_what_the_converter_writes(files):
    """The converter's names and metadata this test depends on: the architecture, the
    nextn layer appended, the experts as 3-D tensors, the shared expert and its gate, and
    Qwen3-Next's ``ssm_ba`` beside Qwen3.5's split q/k/v and z."""
    from shared import gguf_source

    reader = gguf_source._open(files.f32)
    assert reader.get_field("general.architecture").contents() == files.arch
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith(files.arch + ".")}
    assert fields[f"{files.arch}.block_count"] == 5 and fields[f"{files.arch}.nextn_predict_layers"] == 1
    assert fields[f"{files.arch}.expert_shared_feed_forward_length"] == 48
    names = {t.name for t in reader.tensors}
    ba = {"blk.0.ssm_ba.weight"} if files.arch == "qwen3next" else {"blk.0.ssm_beta.weight", "blk.0.ssm_alpha.weight"}
    assert {"blk.0.attn_qkv.weight", "blk.0.attn_gate.weight", "blk.0.ffn_gate_inp.weight",
            "blk.0.ffn_gate_exps.weight", "blk.0.ffn_down_exps.weight", "blk.0.ffn_gate_inp_shexp.weight",
            "blk.0.ffn_up_shexp.weight", "blk.3.attn_q.weight", "blk.4.nextn.eh_proj.weight", *ba} <= names


def test_f32_file_serves_transformers_greedy_tokens(files, tmp_path):
    _served_equal_transformers(files.f32, files.ckpt, tmp_path)


def test_q8_0_file_serves_quantized_as_its_dequantized_weights(files, tmp_path):
    _served_equal_transformers(files.q8, files.dequantized, tmp_path)
    assert "experts kept quantized (Q8_0) in" in (tmp_path / "log.txt").read_text()
