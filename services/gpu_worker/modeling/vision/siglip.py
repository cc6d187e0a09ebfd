"""SigLIP vision tower and Idefics3 / SmolVLM connector in plain torch.

The vision-language models we serve encode images with a SigLIP ViT: Idefics3 and SmolVLM
(`Idefics3VisionTransformer` / `SmolVLMVisionTransformer`, the NaViT-flavoured copy) and Gemma 3
(`SiglipVisionModel`). Both are the same network: a patchifying Conv2d, a learned position
embedding, pre-norm encoder layers (bidirectional attention, tanh-GELU MLP) and a final LayerNorm.

Only full tiles are supported. Idefics3's / SmolVLM's processor splits every image into square
tiles of exactly `image_size` (plus one resized global tile) and Gemma 3's resizes to `image_size`,
so no tile carries padding: there is no patch attention mask, and attention is plain
`scaled_dot_product_attention` over all patches. Any other input size raises ValueError.

Position ids. SigLIP adds `position_embedding(arange(patches))`. Idefics3 / SmolVLM instead compute
them by bucketing fractional patch coordinates (NaViT), which for a full tile is *not* always
arange: float32 rounding makes some grid sides (19, 25, 29, 31, ...) repeat or skip ids. The real
checkpoints' sides (26, 27, 32) give arange, but to stay exact for any config
`bucketed_positions=True` reproduces transformers' computation once at build time.

Parameter names match transformers', so a checkpoint's tensors load with the prefix stripped
(see `load_prefixed`): in transformers' own state dicts the prefixes are
`model.vision_model.` (Idefics3, SmolVLM, the same on disk) and `model.vision_tower.` (Gemma 3 in
transformers 5, whose `SiglipVisionModel` dropped the inner `vision_model.`). Gemma 3's files say
`vision_tower.vision_model.` as Google published them, `vision_tower.` when saved by transformers 5.
Gemma 3 sets `vision_use_head=False` (SiglipVisionConfig's default is True): no `head` to load.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_DEFAULTS: dict[str, Any] = {"num_channels": 3, "layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh"}
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size", "patch_size")


def _vision_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The keys the tower reads, with transformers' defaults for those a config.json may omit.

    Saved configs drop values equal to the class defaults; the defaults of the size keys differ
    between `Idefics3VisionConfig` and `SiglipVisionConfig`, so those must be given.
    """
    missing = [k for k in _REQUIRED if k not in config]
    if missing:
        raise ValueError(f"vision config lacks {missing}")
    cfg = {**_DEFAULTS, **{k: config[k] for k in (*_REQUIRED, *_DEFAULTS) if k in config}}
    if cfg["hidden_act"] not in ("gelu_pytorch_tanh", "gelu"):
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported")
    if cfg["hidden_size"] % cfg["num_attention_heads"]:
        raise ValueError("hidden_size must be divisible by num_attention_heads")
    if config.get("vision_use_head"):
        raise ValueError("vision_use_head=True (the attention-pooling head) is not supported")
    return cfg


def bucketed_position_ids(side: int) -> torch.Tensor:
    """Idefics3's NaViT position ids for a full `side` x `side` patch grid, as transformers computes them.

    Mirrors `Idefics3VisionEmbeddings.forward` with an all-true patch mask, in float32 on the CPU,
    so the rounding (and hence any repeated ids) is the same as transformers' on the CPU.
    """
    boundaries = torch.arange(1 / side, 1.0, 1 / side)
    step = 1.0 / torch.tensor([side])
    coords = torch.arange(side, dtype=torch.float32)[None, :] * step[:, None]
    coords = torch.clamp(coords, max=(1.0 - 1e-6))
    buckets = torch.bucketize(coords, boundaries, right=True)[0]
    return (buckets[:, None] * side + buckets[None, :]).reshape(-1)


class SiglipVisionEmbeddings(nn.Module):
    """Patchify with a stride-`patch_size` Conv2d and add the learned position embedding."""

    def __init__(self, cfg: Mapping[str, Any], bucketed_positions: bool) -> None:
        super().__init__()
        self.image_size, self.patch_size = int(cfg["image_size"]), int(cfg["patch_size"])
        hidden = int(cfg["hidden_size"])
        self.patch_embedding = nn.Conv2d(
            int(cfg["num_channels"]), hidden, kernel_size=self.patch_size, stride=self.patch_size, padding="valid"
        )
        self.side, self.bucketed = self.image_size // self.patch_size, bucketed_positions
        self.position_embedding = nn.Embedding(self.side * self.side, hidden)
        self.position_ids: torch.Tensor
        self.register_buffer("position_ids", self._position_ids(), persistent=False)

    def _position_ids(self) -> torch.Tensor:
        side = self.side
        return bucketed_position_ids(side) if self.bucketed else torch.arange(side * side)

    def reset_buffers(self) -> None:
        """The position ids again, on the CPU: a model built on the meta device (the
        worker's loader) has none until its weights are real."""
        with torch.device("cpu"):
            self.position_ids = self._position_ids()

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if pixel_values.dim() != 4 or pixel_values.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(
                f"expected full tiles [N, C, {self.image_size}, {self.image_size}], got {tuple(pixel_values.shape)}"
            )
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        return patches.flatten(2).transpose(1, 2) + self.position_embedding(self.position_ids)


class SiglipAttention(nn.Module):
    """Bidirectional multi-head self-attention over all patches of a tile (no mask: tiles are full)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, s, _ = x.shape
        q = self.q_proj(x).view(n, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(n, s, self.heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(n, s, self.heads, self.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
        return self.out_proj(o.transpose(1, 2).reshape(n, s, -1))


class SiglipMLP(nn.Module):
    """fc1, GELU (tanh approximation for `gelu_pytorch_tanh`), fc2."""

    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.approximate = "tanh" if act == "gelu_pytorch_tanh" else "none"
        self.fc1 = nn.Linear(hidden, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class SiglipEncoderLayer(nn.Module):
    """Pre-norm transformer layer: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        hidden, eps = int(cfg["hidden_size"]), float(cfg["layer_norm_eps"])
        self.self_attn = SiglipAttention(hidden, int(cfg["num_attention_heads"]))
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = SiglipMLP(hidden, int(cfg["intermediate_size"]), str(cfg["hidden_act"]))
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    """The stack of encoder layers (a module of its own so the names read `encoder.layers.N.*`)."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(cfg) for _ in range(int(cfg["num_hidden_layers"])))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class SiglipVisionTower(nn.Module):
    """SigLIP ViT over full square tiles: `[N, C, S, S]` pixels to `[N, (S // patch)^2, hidden]` features.

    `config` is the vision config as a dict (`Idefics3VisionConfig`, `SmolVLMVisionConfig` or
    `SiglipVisionConfig` keys). `bucketed_positions=True` for Idefics3 / SmolVLM (NaViT position ids,
    see the module docstring), False for plain SigLIP (Gemma 3). The output is after
    `post_layernorm`, i.e. transformers' `last_hidden_state`.
    """

    def __init__(self, config: Mapping[str, Any], *, bucketed_positions: bool = False) -> None:
        super().__init__()
        cfg = _vision_config(config)
        self.hidden_size = int(cfg["hidden_size"])
        self.embeddings = SiglipVisionEmbeddings(cfg, bucketed_positions)
        self.encoder = SiglipEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(self.hidden_size, eps=float(cfg["layer_norm_eps"]))

    @property
    def num_patches(self) -> int:
        """Patches per tile, the length of each output sequence."""
        return int(self.embeddings.position_ids.numel())

    def reset_buffers(self) -> None:
        self.embeddings.reset_buffers()

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.post_layernorm(self.encoder(self.embeddings(pixel_values)))


def pixel_shuffle(x: torch.Tensor, scale_factor: int) -> torch.Tensor:
    """Idefics3's space-to-depth: `[N, h*w, d]` to `[N, h*w / s^2, d * s^2]`.

    Each output token is an s x s block of neighbouring patches, channels ordered (row in block,
    column in block, d); tokens run over blocks in row-major order. This is the same permutation
    as transformers' chain of view / permute / reshape in `Idefics3Connector.pixel_shuffle` (and
    SmolVLM's identical copy), written as one 6-d permute.
    """
    n, seq, d = x.shape
    side = math.isqrt(seq)
    s = scale_factor
    if side * side != seq or side % s:
        raise ValueError(f"pixel_shuffle needs a square grid with side divisible by {s}, got {seq} patches")
    x = x.reshape(n, side // s, s, side // s, s, d).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(n, seq // (s * s), s * s * d)


class Idefics3ModalityProjection(nn.Module):
    """`modality_projection`: one bias-free Linear from shuffled vision features to the text width."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Idefics3Connector(nn.Module):
    """Idefics3 / SmolVLM connector: pixel shuffle by `scale_factor`, then `modality_projection.proj`.

    `[N, patches, vision_hidden]` to `[N, patches / scale_factor^2, text_hidden]`. Load with the
    prefix `model.connector.`.
    """

    def __init__(self, vision_hidden: int, text_hidden: int, scale_factor: int) -> None:
        super().__init__()
        self.scale_factor = int(scale_factor)
        self.modality_projection = Idefics3ModalityProjection(vision_hidden * self.scale_factor**2, text_hidden)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.modality_projection(pixel_shuffle(features, self.scale_factor))


def load_prefixed(module: nn.Module, state: Mapping[str, torch.Tensor], prefix: str) -> None:
    """Load the entries of `state` whose keys start with `prefix` (stripped) into `module`, strictly.

    Keys outside the prefix are ignored (a whole checkpoint can be passed); a parameter the
    module has but `state` lacks, or a prefixed key the module does not know, raises ValueError
    naming them, before anything is copied.
    """
    sub = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    expected = set(module.state_dict())
    missing, unexpected = sorted(expected - sub.keys()), sorted(sub.keys() - expected)
    if missing or unexpected:
        raise ValueError(
            f"loading {type(module).__name__} from {prefix!r}: missing {[prefix + k for k in missing]}, "
            f"unexpected {[prefix + k for k in unexpected]}"
        )
    module.load_state_dict(sub, strict=True)
