"""A tiny random BAGEL (ByteDance-Seed/BAGEL-7B-MoT) checkpoint in the Hub's folder layout,
and ByteDance's own code as the reference (`bagel2` 0.0.6 on PyPI repackages it unchanged;
scripts/test installs it with --no-deps).

The folder holds what the reference's loader reads (its app: `llm_config.json`,
`vit_config.json`, `ae.safetensors`, `ema.safetensors`, the Qwen2 tokenizer files) and the
Hub's `config.json` (`model_type` "bagel", `BagelForConditionalGeneration`, the three
configs nested). `ema.safetensors` is the state dict of the reference's own `Bagel` built
as its app builds it (qk-norm, untied head, `Qwen2MoTDecoderLayer`, the ViT one layer
shorter than vit_config.json says, its patch Conv2d turned into a Linear), weights random.

The reference imports `flash_attn` (its varlen attention, CUDA only) and, through its
transforms, `torchvision` and `cv2`, none of which load here: `_stub_missing` puts in
their place a varlen attention over torch's SDPA (causal blocks bottom-right aligned, as
flash-attn 2.1+), torchvision's `ToTensor`, `Normalize` and PIL `resize` (what BAGEL's
`ImageTransform` calls on a PIL image), and an empty cv2 (imported, unused on this path).

Precision: the reference casts q/k/v to bfloat16 right before attention (flash-attn takes
no float32). `reference_chat(..., dtype="float32")` runs it in float32 throughout by giving
its two attention modules a `torch` whose `bfloat16` is float32 (`_float32_attention`);
everything else is ByteDance's code as shipped.
"""

from __future__ import annotations

import importlib.machinery
import json
import sys
import types
from pathlib import Path
from typing import Any

from tests.checkpoints import make_tokenizer

#: the tokens BAGEL's `add_special_tokens` looks up, and the placeholder mstar's prompt
#: writes for each ViT row (the reference has no token for them)
BAGEL_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
TINY_LLM = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                hidden_act="silu", tie_word_embeddings=False, max_window_layers=2, use_sliding_window=False,
                sliding_window=None, model_type="qwen2", architectures=["Qwen2ForCausalLM"])
#: SigLIP so400m's geometry cut down: 14 px patches, 980 px (70 patches a side, BAGEL's
#: vit_max_num_patch_per_side); 3 layers in the file, 2 used (the app drops one)
TINY_VIT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, num_channels=3,
                image_size=980, patch_size=14, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6,
                attention_dropout=0.0, model_type="siglip_vision_model")
#: FLUX's autoencoder cut down (z 16 channels, 8x down as BAGEL's; GroupNorm's 32 groups
#: need 32 channels). The reference's `load_ae` hard-codes FLUX's full size, so
#: `build_reference` builds its `AutoEncoder` with these and loads ae.safetensors into it
TINY_AE = dict(resolution=256, in_channels=3, downsample=8, ch=32, out_ch=3, ch_mult=[1, 1, 1, 1], num_res_blocks=1,
               z_channels=16, scale_factor=0.3611, shift_factor=0.1159)
MAX_LATENT_SIZE = 64


def _stub_missing() -> None:
    """flash_attn, torchvision and cv2 as the reference's inference path uses them."""
    import torch
    import transformers.modeling_utils  # noqa: F401  (before the stubs: it probes what is installed)

    if "flash_attn" not in sys.modules:
        fa = types.ModuleType("flash_attn")
        fa.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
        fa.flash_attn_varlen_func = _varlen_attention  # type: ignore[attr-defined]
        sys.modules["flash_attn"] = fa
    if "cv2" not in sys.modules:
        sys.modules["cv2"] = types.ModuleType("cv2")
    try:
        import torchvision  # noqa: F401
    except Exception:
        tv = types.ModuleType("torchvision")
        tv.__spec__ = importlib.machinery.ModuleSpec("torchvision", None)
        tr = types.ModuleType("torchvision.transforms")
        fn = types.ModuleType("torchvision.transforms.functional")

        class InterpolationMode:
            BICUBIC, BILINEAR, NEAREST = 3, 2, 0

        def resize(img, size, interpolation=3, antialias=True):  # torchvision's PIL path: PIL's resize
            return img.resize((size[1], size[0]), interpolation)

        def to_tensor(img):
            import numpy as np

            return torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1).float().div(255)

        class Normalize:
            def __init__(self, mean, std, inplace=False):
                self.mean, self.std = torch.tensor(mean)[:, None, None], torch.tensor(std)[:, None, None]

            def __call__(self, x):
                return (x - self.mean) / self.std

        fn.resize = resize  # type: ignore[attr-defined]
        tr.InterpolationMode, tr.functional, tr.Normalize = InterpolationMode, fn, Normalize  # type: ignore[attr-defined]
        tr.ToTensor = lambda: to_tensor  # type: ignore[attr-defined]
        tr.Compose = lambda ts: (lambda x: [x := t(x) for t in ts][-1])  # type: ignore[attr-defined]
        tv.transforms = tr  # type: ignore[attr-defined]
        sys.modules.update({"torchvision": tv, "torchvision.transforms": tr, "torchvision.transforms.functional": fn})


def _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, causal=False,
                      **_: Any):
    """flash-attn's `flash_attn_varlen_func` over SDPA: [T, H, D] packed sequences, GQA by
    repeating K/V heads, a causal block aligned to the bottom right of its keys."""
    import torch
    import torch.nn.functional as F

    out = []
    groups = q.shape[1] // k.shape[1]
    for i in range(len(cu_seqlens_q) - 1):
        qs = q[cu_seqlens_q[i]:cu_seqlens_q[i + 1]].transpose(0, 1)
        ks = k[cu_seqlens_k[i]:cu_seqlens_k[i + 1]].repeat_interleave(groups, dim=1).transpose(0, 1)
        vs = v[cu_seqlens_k[i]:cu_seqlens_k[i + 1]].repeat_interleave(groups, dim=1).transpose(0, 1)
        mask = None
        if causal:
            nq, nk = qs.shape[1], ks.shape[1]
            mask = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
        out.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask).transpose(0, 1))
    return torch.cat(out)


def _float32_attention(on: bool = True) -> None:
    """The reference's attention modules see a `torch` whose bfloat16 is float32, so their
    casts before flash-attn keep float32 (the only change to its float32 arithmetic); `on`
    False gives them the real torch back (a bfloat16 reference after a float32 one in the
    same process)."""
    import torch
    from bagel2.modeling.bagel import qwen2_navit, siglip_navit

    if not on:
        for mod in (qwen2_navit, siglip_navit):
            mod.torch = torch  # type: ignore[attr-defined]
        return

    class _Torch(types.ModuleType):
        bfloat16 = torch.float32

        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

    for mod in (qwen2_navit, siglip_navit):
        mod.torch = _Torch("torch")  # type: ignore[attr-defined]


def _tokenizer(path: Path) -> Any:
    """Qwen2's byte-level BPE (tests.checkpoints) with BAGEL's vision tokens as specials,
    also written as vocab.json + merges.txt (the files the Hub ships)."""
    from tokenizers import AddedToken, Tokenizer

    make_tokenizer(path, family="qwen2")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in BAGEL_SPECIALS])
    tok.save(str(path / "tokenizer.json"))
    model = json.loads(tok.to_str())["model"]
    (path / "vocab.json").write_text(json.dumps(model["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2TokenizerFast", "eos_token": "<|im_end|>", "bos_token": None,
        "pad_token": "<|endoftext|>", "model_max_length": 4096,
    }))
    return tok


def build_reference(path: Path, dtype: str = "float32") -> dict[str, Any]:
    """The reference's model, ViT transform, tokenizer and token ids, loaded from `path` as
    BAGEL's app loads them (its config fix-ups, `load_ae`, ema.safetensors)."""
    import torch
    from safetensors.torch import load_file

    _stub_missing()
    from bagel2.data.data_utils import add_special_tokens
    from bagel2.data.transforms import ImageTransform
    from bagel2.modeling.autoencoder import AutoEncoder, AutoEncoderParams
    from bagel2.modeling.bagel import (
        Bagel,
        BagelConfig,
        Qwen2ForCausalLM,
        SiglipVisionModel,
    )
    from transformers import AutoTokenizer

    _float32_attention(dtype == "float32")
    llm_config, vit_config = _configs(path)
    vae_config = AutoEncoderParams(**TINY_AE)
    vae_model = AutoEncoder(vae_config)
    vae_model.load_state_dict(load_file(str(path / "ae.safetensors")))
    config = BagelConfig(visual_gen=True, visual_und=True, llm_config=llm_config, vit_config=vit_config,
                         vae_config=vae_config, vit_max_num_patch_per_side=70, connector_act="gelu_pytorch_tanh",
                         latent_patch_size=2, max_latent_size=MAX_LATENT_SIZE)
    model = Bagel(Qwen2ForCausalLM(llm_config), SiglipVisionModel(vit_config), config)
    model.vit_model.vision_model.embeddings.convert_conv2d_to_linear(vit_config)
    missing, unexpected = model.load_state_dict(load_file(str(path / "ema.safetensors")), strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    torch_dtype = getattr(torch, dtype)
    model = model.to(torch_dtype).eval()
    tokenizer, new_token_ids, _ = add_special_tokens(AutoTokenizer.from_pretrained(str(path)))
    return dict(model=model, vae=vae_model.eval(), tokenizer=tokenizer, ids=new_token_ids,
                vit_transform=ImageTransform(980, 224, 14), vae_transform=ImageTransform(1024, 512, 16))


def _default_rope(config: Any, device: Any = None, **_: Any) -> tuple[Any, float]:
    """transformers 4's `_compute_default_rope_parameters`: plain RoPE of `rope_theta`."""
    import torch

    dim = config.hidden_size // config.num_attention_heads
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return inv_freq, 1.0


def _configs(path: Path) -> tuple[Any, Any]:
    """The LLM's and the ViT's configs with BAGEL's app's fix-ups (qk-norm, untied head, the
    MoT layer; no ViT RoPE, one ViT layer fewer), and the attributes transformers 4 gave
    every config that transformers 5's no longer has (`pad_token_id`)."""
    from bagel2.modeling.bagel import Qwen2Config, SiglipVisionConfig
    from bagel2.modeling.qwen2 import modeling_qwen2

    if "default" not in modeling_qwen2.ROPE_INIT_FUNCTIONS:  # transformers 5 dropped it from the table
        modeling_qwen2.ROPE_INIT_FUNCTIONS = dict(modeling_qwen2.ROPE_INIT_FUNCTIONS, default=_default_rope)
    llm_config = Qwen2Config.from_json_file(str(path / "llm_config.json"))
    llm_config.qk_norm, llm_config.tie_word_embeddings = True, False
    llm_config.layer_module = "Qwen2MoTDecoderLayer"
    if not hasattr(llm_config, "pad_token_id"):
        llm_config.pad_token_id = None
    vit_config = SiglipVisionConfig.from_json_file(str(path / "vit_config.json"))
    vit_config.rope = False
    vit_config.num_hidden_layers -= 1
    return llm_config, vit_config


def _new_model(path: Path, seed: int) -> Any:
    """The reference's `Bagel` for the folder's configs, every weight random (seeded)."""
    import torch

    _stub_missing()
    from bagel2.modeling.bagel import (
        Bagel,
        BagelConfig,
        Qwen2ForCausalLM,
        SiglipVisionModel,
    )

    llm_config, vit_config = _configs(path)
    ae = types.SimpleNamespace(downsample=TINY_AE["downsample"], z_channels=TINY_AE["z_channels"])
    config = BagelConfig(visual_gen=True, visual_und=True, llm_config=llm_config, vit_config=vit_config,
                         vae_config=ae, vit_max_num_patch_per_side=70, connector_act="gelu_pytorch_tanh",
                         latent_patch_size=2, max_latent_size=MAX_LATENT_SIZE)
    torch.manual_seed(seed)
    model = Bagel(Qwen2ForCausalLM(llm_config), SiglipVisionModel(vit_config), config)
    model.vit_model.vision_model.embeddings.convert_conv2d_to_linear(vit_config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("pos_embed"):
                continue  # fixed sin-cos tables
            if name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / p.shape[-1] ** 0.5 if p.dim() > 1 else 0.1))
    return model


def _autoencoder(path: Path, seed: int) -> None:
    """ae.safetensors: the reference's FLUX `AutoEncoder` with TINY_AE's shape, random."""
    import torch
    from safetensors.torch import save_file

    _stub_missing()
    from bagel2.modeling.autoencoder import AutoEncoder, AutoEncoderParams

    torch.manual_seed(seed + 1)
    ae = AutoEncoder(AutoEncoderParams(**TINY_AE))
    save_file({k: v.contiguous() for k, v in ae.state_dict().items()}, str(path / "ae.safetensors"))


def make_bagel_checkpoint(path: Path, seed: int = 0, llm_shape: dict[str, Any] | None = None) -> Path:
    """Write the tiny BAGEL folder at `path` (module docstring; the LLM's sizes overridden by
    `llm_shape`: the bench's wider one); returns `path`."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(path)
    llm = dict(TINY_LLM, **(llm_shape or {}), vocab_size=tok.get_vocab_size())
    (path / "llm_config.json").write_text(json.dumps(llm))
    (path / "vit_config.json").write_text(json.dumps(TINY_VIT))
    (path / "config.json").write_text(json.dumps({
        "model_type": "bagel", "architectures": ["BagelForConditionalGeneration"], "llm_config": llm,
        "vit_config": TINY_VIT, "vae_config": TINY_AE, "latent_patch_size": 2, "max_latent_size": MAX_LATENT_SIZE,
        "vit_max_num_patch_per_side": 70, "connector_act": "gelu_pytorch_tanh", "interpolate_pos": False,
        "timestep_shift": 1.0,
    }))
    model = _new_model(path, seed)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "ema.safetensors"))
    _autoencoder(path, seed)
    return path


def reference_chat(ref: dict[str, Any], inputs: list[Any], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """BAGEL's understanding (`InterleaveInferencer.interleave_inference(inputs,
    understanding_output=True)`, greedy; `inputs` PIL images and texts in order): the ids
    it generates after its fed `<|im_start|>`, up to and without `<|im_end|>`, and each
    one's log-probability (its `lm_head` logits, log-softmaxed)."""
    import torch
    from bagel2.inferencer import InterleaveInferencer

    inf = InterleaveInferencer(ref["model"], ref["vae"], ref["tokenizer"], ref["vae_transform"],
                               ref["vit_transform"], ref["ids"])
    captured: list[torch.Tensor] = []
    logits: list[torch.Tensor] = []
    model = ref["model"]
    generate, head = model.generate_text, model.language_model.lm_head.forward

    def keep(**kw: Any) -> torch.Tensor:
        out = generate(**kw)
        captured.append(out)
        return out

    def keep_logits(x: torch.Tensor) -> torch.Tensor:
        out = head(x)
        logits.append(out.float().log_softmax(-1)[0])
        return out

    model.generate_text, model.language_model.lm_head.forward = keep, keep_logits
    try:
        # bfloat16 weights: under autocast, as its CUDA path runs (its own autocast is CUDA's)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=model.dtype == torch.bfloat16):
            inf.interleave_inference(list(inputs), understanding_output=True, do_sample=False,
                                     max_think_token_n=max_new_tokens + 1)
    except IndexError:
        pass  # it decodes its answer and splits on <|im_start|>, which random weights may not emit
    finally:
        del model.generate_text, model.language_model.lm_head.forward
    ids = captured[0][1:, 0].tolist()  # [0] is the start token it feeds
    return ids, [float(lp[t]) for lp, t in zip(logits, ids)]
