"""Pi0 (`PI0ForConditionalGeneration`) and Pi0.5 (`PI05ForConditionalGeneration`) over
paged KV, in plain torch.

Two halves that share each layer's attention: PaliGemma (a SigLIP tower, a linear
projector and a Gemma LM) makes the prefix, whose rows (image rows, then the prompt's
tokens) attend to each other both ways and whose K/V go into the request's pages once;
the action expert (a second, narrower Gemma with the same layer count, KV heads and head
size) runs every flow-matching step over chunk + 1 rows (the state's row, then the
action chunk's), each of its layers reading the same layer's prefix K/V read-only. The
state's row sees the prefix and itself; an action row sees the prefix, the state and the
whole chunk (transformers' two blocks). Pi0.5 has no state row (its state is text in
the prompt) and its expert's norms are adaptive: scale, shift and a residual gate
predicted from the time's features (`PI05AdaptiveRMSNorm`). Parameter names are the checkpoint's as the Hub
ships it (`paligemma_with_expert.paligemma.model.*`, `paligemma_with_expert.gemma_expert.*`,
`action_in_proj`, ...).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from services.gpu_worker.attention import AttnMetadata, paged_attention, write_kv
from services.gpu_worker.modeling.base import PolicyModel
from services.gpu_worker.modeling.policy.gemma_layers import (
    GemmaAttention,
    GemmaLayer,
    GemmaMLP,
    GemmaRMSNorm,
    project_qkv,
    rope_tables,
    rope_theta,
)
from services.gpu_worker.modeling.vision.siglip import SiglipVisionTower

VLM = "paligemma_with_expert.paligemma.model."
EXPERT = "paligemma_with_expert.gemma_expert."


class GemmaStack(nn.Module):
    """`layers.N.*` and the final `norm` (a module of its own so the names read `model.layers.N`)."""

    def __init__(self, cfg: Mapping[str, Any], embed: bool) -> None:
        super().__init__()
        if embed:
            self.embed_tokens = nn.Embedding(int(cfg["vocab_size"]), int(cfg["hidden_size"]))
        self.layers = nn.ModuleList(GemmaLayer(cfg) for _ in range(int(cfg["num_hidden_layers"])))
        self.norm = GemmaRMSNorm(int(cfg["hidden_size"]), float(cfg.get("rms_norm_eps", 1e-6)))


class Projector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(vision_hidden, text_hidden)


class PaliGemmaPolicy(PolicyModel):
    """What Pi0 and Pi0.5 share: the PaliGemma prefix (tower, projector, Gemma LM) over
    paged KV, the sinusoidal time features, the action projections and the weights' names;
    a subclass adds its action expert (`self.expert`) and `velocity`."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        vlm, dit = config["vlm_config"], config["dit_config"]
        text = vlm["text_config"]
        self.text_cfg, self.dit_cfg = dict(text), dict(dit)
        self.chunk = int(config.get("chunk_size", 50))
        self.min_period = float(config.get("min_period", 4e-3))
        self.max_period = float(config.get("max_period", 4.0))
        width, action_dim = int(dit["hidden_size"]), int(config.get("max_action_dim", 32))
        self.vision_tower = SiglipVisionTower(vlm["vision_config"])
        self.multi_modal_projector = Projector(int(vlm["vision_config"]["hidden_size"]),
                                               int(vlm.get("projection_dim", text["hidden_size"])))
        self.language_model = GemmaStack(text, embed=True)
        self.action_in_proj = nn.Linear(action_dim, width)
        self.action_out_proj = nn.Linear(width, action_dim)
        self.head_dim = int(text["head_dim"])
        self.theta = rope_theta(text)
        self.dit_theta = rope_theta(dit)

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        renamed: dict[str, torch.Tensor] = {}
        for name, tensor in state.items():
            if name.startswith(EXPERT + "lm_head") or name.startswith(VLM + "language_model.lm_head"):
                continue  # the action expert's and the LM's heads are never read
            if name.startswith(VLM + "language_model.model."):
                name = "language_model." + name.removeprefix(VLM + "language_model.model.")
            elif name.startswith(VLM):
                name = name.removeprefix(VLM)
            elif name.startswith(EXPERT + "model."):
                name = "expert." + name.removeprefix(EXPERT + "model.")
            renamed[name] = tensor
        missing, unexpected = self.load_state_dict(renamed, strict=False)
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match Pi0: missing {missing[:5]}, unexpected {unexpected[:5]}")

    def reset_buffers(self) -> None:
        self.vision_tower.reset_buffers()

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Cameras [N, C, H, W] -> their rows [N * tokens per image, text hidden]."""
        rows = self.multi_modal_projector.linear(self.vision_tower(pixel_values))
        return rows.reshape(-1, rows.shape[-1])

    def prefix(self, input_ids: torch.Tensor, positions: torch.Tensor, image_rows: torch.Tensor,
               image_at: torch.Tensor, kv_caches: list[torch.Tensor], metas: list[AttnMetadata]) -> None:
        """Every layer's K/V of the step's prefix rows into their pages (bidirectional
        attention: `metas` built with causal=False); the image rows replace their tokens'."""
        lm = self.language_model
        scale = torch.tensor(math.sqrt(float(self.text_cfg["hidden_size"])), dtype=lm.embed_tokens.weight.dtype)
        x = lm.embed_tokens(input_ids) * scale
        if image_at.numel():
            x[image_at] = image_rows.to(x.dtype)
        cos, sin = rope_tables(positions, self.head_dim, self.theta)
        layers = list(cast("Iterable[GemmaLayer]", lm.layers))
        for i, (layer, cache, meta) in enumerate(zip(layers, kv_caches, metas)):
            q, k, v = layer.qkv(x, cos, sin)
            write_kv(cache, k.contiguous(), v.contiguous(), meta)
            if i == len(layers) - 1:
                break  # the last layer's output is read by nobody: its K/V are all the expert needs
            o = paged_attention(q.contiguous(), cache, meta, self.head_dim**-0.5)
            x = layer.finish(x, o.reshape(x.shape[0], -1))

    def time_embedding(self, time: torch.Tensor) -> torch.Tensor:
        """[B] -> [B, width]: sin and cos of the time at periods from min to max (float32)."""
        width = int(self.dit_cfg["hidden_size"])
        fraction = torch.linspace(0.0, 1.0, width // 2, dtype=torch.float32, device=time.device)
        period = self.min_period * (self.max_period / self.min_period) ** fraction
        freq = 1.0 / period * 2 * math.pi
        emb = freq[None, :] * time[:, None]
        return torch.cat([emb.sin(), emb.cos()], dim=1)


class Pi0Policy(PaliGemmaPolicy):
    """Pi0: the state is a row of the expert's input (before the chunk), the time is mixed
    into each action row by an MLP, the expert is a plain Gemma."""

    state_row = True

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        dit = config["dit_config"]
        width, state_dim = int(dit["hidden_size"]), int(config.get("max_state_dim", 32))
        self.expert = GemmaStack(dit, embed=False)
        self.state_proj = nn.Linear(state_dim, width)
        self.action_time_mlp_in = nn.Linear(2 * width, width)
        self.action_time_mlp_out = nn.Linear(width, width)

    def embed_state(self, state: torch.Tensor) -> torch.Tensor:
        """[B, max state dim] -> the state's row [B, width] of the expert's input."""
        return self.state_proj(state)

    def velocity(self, state_rows: torch.Tensor, noise: torch.Tensor, time: torch.Tensor,
                 prefix_kv: list[tuple[torch.Tensor, torch.Tensor]], prefix_mask: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
        """One flow-matching step's velocity [B, chunk, action dim] for noisy actions `noise`
        at `time` [B]: `prefix_kv[i]` is layer i's prefix K and V [B, Pmax, kv heads, D]
        (read-only), `prefix_mask` [B, Pmax] which of them are real, `positions` [B, chunk + 1]."""
        actions = self.action_in_proj(noise)
        times = self.time_embedding(time)[:, None, :].expand_as(actions).to(actions.dtype)
        mixed = self.action_time_mlp_out(F.silu(self.action_time_mlp_in(torch.cat([actions, times], dim=2))))
        x = torch.cat([state_rows[:, None, :], mixed], dim=1)
        b, rows = x.shape[:2]
        own = torch.ones(rows, rows, dtype=torch.bool, device=x.device)
        own[0, 1:] = False  # the state's row does not see the chunk
        mask = torch.cat([prefix_mask[:, None, :].expand(b, rows, -1), own[None].expand(b, -1, -1)], dim=2)
        cos, sin = rope_tables(positions, self.head_dim, self.dit_theta)
        for layer, (pk, pv) in zip(cast("Iterable[GemmaLayer]", self.expert.layers), prefix_kv):
            q, k, v = layer.qkv(x, cos, sin)
            keys = torch.cat([pk, k], dim=1).transpose(1, 2)
            values = torch.cat([pv, v], dim=1).transpose(1, 2)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask[:, None],
                                               scale=self.head_dim**-0.5, enable_gqa=True)
            x = layer.finish(x, o.transpose(1, 2).reshape(b, rows, -1))
        return self.action_out_proj(self.expert.norm(x)[:, 1:])


class Pi05Policy(PaliGemmaPolicy):
    """Pi0.5: the chunk's rows alone, every norm of the expert modulated by the time."""

    state_row = False

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        dit = config["dit_config"]
        width = int(dit["hidden_size"])
        self.expert = AdaGemmaStack(dit)
        self.time_mlp_in = nn.Linear(width, width)
        self.time_mlp_out = nn.Linear(width, width)

    def embed_state(self, state: torch.Tensor) -> torch.Tensor:
        return state.new_zeros(state.shape[0], 0)  # the state is in the prompt

    def velocity(self, state_rows: torch.Tensor, noise: torch.Tensor, time: torch.Tensor,
                 prefix_kv: list[tuple[torch.Tensor, torch.Tensor]], prefix_mask: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
        """As Pi0's, over the chunk's rows only (`positions` [B, chunk]); each sees them all."""
        x = self.action_in_proj(noise)
        temb = F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(self.time_embedding(time).to(x.dtype)))))
        b, rows = x.shape[:2]
        mask = torch.cat([prefix_mask[:, None, :].expand(b, rows, -1),
                          torch.ones(b, rows, rows, dtype=torch.bool, device=x.device)], dim=2)
        cos, sin = rope_tables(positions, self.head_dim, self.dit_theta)
        for layer, (pk, pv) in zip(cast("Iterable[AdaGemmaLayer]", self.expert.layers), prefix_kv):
            q, k, v, gate = layer.qkv(x, temb, cos, sin)
            keys = torch.cat([pk, k], dim=1).transpose(1, 2)
            values = torch.cat([pv, v], dim=1).transpose(1, 2)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask[:, None],
                                               scale=self.head_dim**-0.5, enable_gqa=True)
            x = layer.finish(x, o.transpose(1, 2).reshape(b, rows, -1), gate, temb)
        return self.action_out_proj(self.expert.norm(x, temb)[0])


class AdaptiveRMSNorm(nn.Module):
    """RMS norm whose scale and shift, and the residual's gate, come from the time's features."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.dense = nn.Linear(dim, 3 * dim)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        scale, shift, gate = self.dense(temb)[:, None, :].chunk(3, dim=-1)
        return (xf * (1.0 + scale.float()) + shift.float()).to(x.dtype), gate.to(x.dtype)


class AdaGemmaLayer(nn.Module):
    """A Gemma layer whose two norms are adaptive and whose residuals are gated."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        hidden, eps = int(cfg["hidden_size"]), float(cfg.get("rms_norm_eps", 1e-6))
        self.input_layernorm = AdaptiveRMSNorm(hidden, eps)
        self.self_attn = GemmaAttention(hidden, int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"]),
                                        int(cfg["head_dim"]))
        self.post_attention_layernorm = AdaptiveRMSNorm(hidden, eps)
        self.mlp = GemmaMLP(hidden, int(cfg["intermediate_size"]))

    def qkv(self, x: torch.Tensor, temb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        h, gate = self.input_layernorm(x, temb)
        q, k, v = project_qkv(self.self_attn, h, cos, sin)
        return q, k, v, gate

    def finish(self, x: torch.Tensor, attn: torch.Tensor, gate: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        x = x + gate * self.self_attn.o_proj(attn)
        h, gate = self.post_attention_layernorm(x, temb)
        return x + gate * self.mlp(h)


class AdaGemmaStack(nn.Module):
    """Pi0.5's action expert: adaptive-norm layers and an adaptive final norm."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(AdaGemmaLayer(cfg) for _ in range(int(cfg["num_hidden_layers"])))
        self.norm = AdaptiveRMSNorm(int(cfg["hidden_size"]), float(cfg.get("rms_norm_eps", 1e-6)))
