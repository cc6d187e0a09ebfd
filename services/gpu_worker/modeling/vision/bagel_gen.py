"""BAGEL's text-to-image path in torch: the mixture-of-transformers LLM with both weight
copies, the flow-matching loop with its three-branch guidance, and FLUX's autoencoder
decoder. In process (not yet on the engine: its context K/V are plain tensors here).

Op for op as ByteDance's `Bagel.generate_image` / `_forward_flow` and `InterleaveInferencer`:
- context K/V per branch, computed once by the understanding weights (causal): "full" (the
  prompt's `<|im_start|>text<|im_end|>`), "no text" (the context before the text: empty for
  text-to-image) and "no image" (the context without images: the full one for
  text-to-image). The reference keeps them as its `NaiveCache`s and reads them every step;
- each step: the query rows `<|vision_start|>`, one row per latent patch (2 x 2 latent
  pixels x 16 channels), `<|vision_end|>`, all at one RoPE position (the context's length),
  attending to the branch's context and to each other both ways. Tag rows run the
  understanding weights, latent rows the generation copy (`*_moe_gen`); a latent row's
  input is `vae2llm(x_t) + time_embedder(t) + latent_pos_embed[row * 64 + column]`, its
  velocity `llm2vae` of its final-normed (`norm_moe_gen`) state;
- guidance inside `cfg_interval`: v_text = v_notext + s_text (v - v_notext), then
  v' = v_noimg + s_img (v_text - v_noimg), renormed to at most |v| ("global": over all
  rows); Euler steps x -= v dt on the shifted timesteps t' = s t / (1 + (s - 1) t);
- decode: the patches back to [16, 2h, 2w], `z / scale + shift`, FLUX's decoder, then
  (x / 2 + 1/2) clamped, times 255, truncated to uint8 as the reference's PIL image.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from services.gpu_worker.modeling.base import ModelBase

#: BAGEL's `max_latent_size` in its app (latent position ids are row * 64 + column)
MAX_LATENT_SIZE = 64
LATENT_PATCH = 2
KV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Query:
    """One branch's query of one step: latents `x` at time `t` of a `height` x `width`
    image, between the image tags, at RoPE `position`, after the context `past` (None:
    empty)."""

    x: torch.Tensor
    t: float
    tags: torch.Tensor
    height: int
    width: int
    past: KV | None
    position: int


class RMSNorm(nn.Module):
    """Qwen2RMSNorm: float32 statistics, weight * x in x's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Mlp(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MotAttention(nn.Module):
    """q/k/v/o and the per-head q/k norms, each twice: understanding and `_moe_gen`."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, eps: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.hidden = heads, kv_heads, hidden // heads, hidden
        for suffix in ("", "_moe_gen"):
            setattr(self, "q_proj" + suffix, nn.Linear(hidden, heads * self.head_dim))
            setattr(self, "k_proj" + suffix, nn.Linear(hidden, kv_heads * self.head_dim))
            setattr(self, "v_proj" + suffix, nn.Linear(hidden, kv_heads * self.head_dim))
            setattr(self, "o_proj" + suffix, nn.Linear(heads * self.head_dim, hidden, bias=False))
            setattr(self, "q_norm" + suffix, RMSNorm(self.head_dim, eps))
            setattr(self, "k_norm" + suffix, RMSNorm(self.head_dim, eps))

    def qkv(self, x: torch.Tensor, gen: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v [T, heads, head_dim] with each row through its copy (`gen` marks latent rows)."""
        out = []
        for name, heads in (("q", self.heads), ("k", self.kv_heads), ("v", self.kv_heads)):
            y = x.new_zeros(x.shape[0], heads, self.head_dim)
            for rows, suffix in ((~gen, ""), (gen, "_moe_gen")):
                part = getattr(self, f"{name}_proj{suffix}")(x[rows]).view(-1, heads, self.head_dim)
                y[rows] = getattr(self, f"{name}_norm{suffix}")(part) if name != "v" else part
            out.append(y)
        return tuple(out)

    def out(self, o: torch.Tensor, gen: torch.Tensor) -> torch.Tensor:
        und: Any = self.o_proj
        gen_proj: Any = self.o_proj_moe_gen
        y = o.new_zeros(o.shape[0], self.hidden)
        y[~gen], y[gen] = und(o[~gen]), gen_proj(o[gen])
        return y


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # Qwen2's rotary embedding returns them in x's dtype
    return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]


class MotLayer(nn.Module):
    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        hidden, eps = int(cfg["hidden_size"]), float(cfg.get("rms_norm_eps", 1e-6))
        self.self_attn = MotAttention(hidden, int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"]), eps)
        for suffix in ("", "_moe_gen"):
            setattr(self, "mlp" + suffix, Mlp(hidden, int(cfg["intermediate_size"])))
            setattr(self, "input_layernorm" + suffix, RMSNorm(hidden, eps))
            setattr(self, "post_attention_layernorm" + suffix, RMSNorm(hidden, eps))

    def _split(self, x: torch.Tensor, gen: torch.Tensor, name: str) -> torch.Tensor:
        y = torch.zeros_like(x)
        y[~gen], y[gen] = getattr(self, name)(x[~gen]), getattr(self, name + "_moe_gen")(x[gen])
        return y

    def forward(self, x: torch.Tensor, gen: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                sets: list[tuple[int, int]], pasts: list[tuple[torch.Tensor, torch.Tensor] | None],
                causal: bool) -> tuple[torch.Tensor, tuple]:
        """Row sets of `x` (start, rows), set i after its context `pasts[i]` (k, v), in one
        pass of the projections and MLPs -> (rows out, the rows' own k, v). Attention stays
        within a set: its context and its own rows (causal, or both ways)."""
        attn = self.self_attn
        q, k, v = attn.qkv(self._split(x, gen, "input_layernorm"), gen)
        q, k = _rotate(q, *rope), _rotate(k, *rope)
        o = torch.cat([self._attend(q[a:a + n], k[a:a + n], v[a:a + n], past, causal)
                       for (a, n), past in zip(sets, pasts)])
        x = x + attn.out(o, gen)
        return x + self._split(self._split(x, gen, "post_attention_layernorm"), gen, "mlp"), (k, v)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None, causal: bool) -> torch.Tensor:
        attn = self.self_attn
        keys, values = (k, v) if past is None else (torch.cat((past[0], k)), torch.cat((past[1], v)))
        groups = attn.heads // attn.kv_heads
        n, m = q.shape[0], keys.shape[0]
        mask = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n) if causal else None
        o = F.scaled_dot_product_attention(q.transpose(0, 1), keys.repeat_interleave(groups, 1).transpose(0, 1),
                                           values.repeat_interleave(groups, 1).transpose(0, 1), attn_mask=mask)
        return o.transpose(0, 1).reshape(n, -1)


class _Backbone(nn.Module):
    """Embeddings, layers and the two final norms (names as the checkpoint's `model.*`)."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        hidden, eps = int(cfg["hidden_size"]), float(cfg.get("rms_norm_eps", 1e-6))
        self.embed_tokens = nn.Embedding(int(cfg["vocab_size"]), hidden)
        self.layers = nn.ModuleList(MotLayer(cfg) for _ in range(int(cfg["num_hidden_layers"])))
        self.norm, self.norm_moe_gen = RMSNorm(hidden, eps), RMSNorm(hidden, eps)


class _Table(nn.Module):
    """A fixed position table (the checkpoint's `pos_embed`)."""

    def __init__(self, rows: int, hidden: int) -> None:
        super().__init__()
        self.pos_embed = nn.Parameter(torch.zeros(rows, hidden), requires_grad=False)


class MotLM(nn.Module):
    """The LLM with both copies (checkpoint names under `language_model.`)."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        hidden = int(cfg["hidden_size"])
        self.model = _Backbone(cfg)
        self.head_dim = hidden // int(cfg["num_attention_heads"])
        self.theta = float(cfg.get("rope_theta", 10000.0))

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        steps = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=positions.device)
        inv = 1.0 / (self.theta ** (steps.float() / self.head_dim))
        freqs = positions.float()[:, None] * inv[None]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def run(self, x: torch.Tensor, gen: torch.Tensor, positions: torch.Tensor, sets: list[tuple[int, int]],
            pasts: list[KV | None], causal: bool) -> tuple[torch.Tensor, KV]:
        """Row sets through every layer (each row by its copy, set i after its context
        `pasts[i]`) -> (final-normed rows, each layer's k, v of every row)."""
        rope, kvs = self.rope(positions), []
        layers: Any = self.model.layers
        for i, layer in enumerate(layers):
            x, kv = layer(x, gen, rope, sets, [None if p is None else p[i] for p in pasts], causal)
            kvs.append(kv)
        y = torch.zeros_like(x)
        y[~gen], y[gen] = self.model.norm(x[~gen]), self.model.norm_moe_gen(x[gen])
        return y, kvs


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden: int, freq: int = 256) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(freq, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.freq = freq

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.freq // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t[:, None].float() * freqs[None]
        first: Any = self.mlp[0]  # the sinusoids in float32, the MLP in its weights' dtype (bf16 without autocast)
        return self.mlp(torch.cat([torch.cos(args), torch.sin(args)], dim=-1).to(first.weight.dtype))


class BagelGenerator(ModelBase):
    """The generation half of a BAGEL checkpoint (module docstring); `load_weights` takes the
    folder's tensors (ema.safetensors and ae.safetensors together) and keeps its parts'."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        from services.gpu_worker.modeling.vision.bagel import BagelConnector, BagelPosEmbed, BagelVit
        from services.gpu_worker.modeling.vision.flux_ae import FluxDecoder, FluxEncoder

        super().__init__()
        llm, ae = config["llm_config"], config["vae_config"]
        hidden = int(llm["hidden_size"])
        self.language_model = MotLM(llm)
        self.time_embedder = TimestepEmbedder(hidden)
        self.latent_channels = int(ae["z_channels"])
        patch_dim = LATENT_PATCH**2 * self.latent_channels
        self.vae2llm, self.llm2vae = nn.Linear(patch_dim, hidden), nn.Linear(hidden, patch_dim)
        self.latent_pos_embed = _Table(MAX_LATENT_SIZE**2, hidden)
        self.ae = FluxDecoder(ae)
        self.downsample = int(ae["downsample"]) * LATENT_PATCH
        # an edit's input image: its ViT rows (understanding) and its autoencoder latents
        self.vae_encoder = FluxEncoder(ae)
        self.vit = BagelVit(config["vit_config"])
        self.connector = BagelConnector(int(config["vit_config"]["hidden_size"]), hidden)
        self.vit_pos_embed = BagelPosEmbed(hidden)

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Its tensors by name (ae's `decoder.*` as `ae.decoder.*`, `encoder.*` as
        `vae_encoder.encoder.*`, the ViT's `vit_model.vision_model.*` as `vit.*`); the text
        head is not its (no text out)."""
        renames = (("decoder.", "ae.decoder."), ("encoder.", "vae_encoder.encoder."),
                   ("vit_model.vision_model.", "vit."))
        mine = {}
        for k, v in state.items():
            if k.startswith("language_model.lm_head."):
                continue
            old = next((a for a, _ in renames if k.startswith(a)), None)
            mine[k if old is None else dict(renames)[old] + k[len(old):]] = v
        self.load_state_dict(mine, strict=True)

    def dtype_(self) -> torch.dtype:
        return self.vae2llm.weight.dtype

    def context(self, ids: torch.Tensor) -> KV:
        """A branch's context K/V (its prompt rows through the understanding weights, causal)."""
        lm = self.language_model
        gen = torch.zeros(len(ids), dtype=torch.bool, device=ids.device)
        positions = torch.arange(len(ids), device=ids.device)
        return lm.run(lm.model.embed_tokens(ids), gen, positions, [(0, len(ids))], [None], causal=True)[1]

    def latent_block(self, x: torch.Tensor, t: float, tags: torch.Tensor, h: int, w: int,
                     position: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """An image block of latents `x` [h * w, patch dim] at time `t` between the tags
        (embedded [2, hidden]): (its rows' inputs, which rows are latent, their positions).
        A query's latents are noisy; an edit's input image is its clean latents at t = 0."""
        dev = x.device
        ids = (torch.arange(h, device=dev)[:, None] * MAX_LATENT_SIZE + torch.arange(w, device=dev)).reshape(-1)
        times = torch.full((len(x),), t, device=dev)
        # the latents may be float32 (the Euler steps' dt is): into the weights' dtype, as autocast does
        rows = self.vae2llm(x.to(self.dtype_())) + self.time_embedder(times) + self.latent_pos_embed.pos_embed[ids]
        gen = torch.ones(len(rows) + 2, dtype=torch.bool, device=dev)
        gen[0] = gen[-1] = False
        return torch.cat((tags[:1], rows, tags[1:])), gen, torch.full((len(rows) + 2,), position, device=dev)

    def velocities(self, queries: list[Query]) -> list[torch.Tensor]:
        """Each query's velocity for its latents [h * w, patch dim], all in one pass (each
        query's rows attend to its own context and to each other only)."""
        seqs, gens, positions, sets, at = [], [], [], [], 0
        tags = self.language_model.model.embed_tokens(queries[0].tags)
        for q in queries:
            seq, gen, pos = self.latent_block(q.x, q.t, tags, q.height // self.downsample,
                                              q.width // self.downsample, q.position)
            seqs.append(seq)
            gens.append(gen)
            positions.append(pos)
            sets.append((at, len(seq)))
            at += len(seq)
        out, _ = self.language_model.run(torch.cat(seqs), torch.cat(gens), torch.cat(positions), sets,
                                         [q.past for q in queries], causal=False)
        v = self.llm2vae(out)
        return [v[a + 1:a + n - 1] for a, n in sets]

    def pixels(self, x: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Latents [h * w, 2 * 2 * C] -> the image float [H, W, 3] in [0, 1]."""
        h, w, p, c = height // self.downsample, width // self.downsample, LATENT_PATCH, self.latent_channels
        z = torch.einsum("nhwpqc->nchpwq", x.reshape(1, h, w, p, p, c)).reshape(1, c, h * p, w * p)
        return (self.ae.decode(z.to(self.dtype_())) * 0.5 + 0.5).clamp(0, 1)[0].permute(1, 2, 0)

    def decode(self, x: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """The image uint8 [H, W, 3] as the reference's PIL image (x 255, truncated)."""
        return (self.pixels(x, height, width) * 255).to(torch.uint8)


def guided(v: torch.Tensor, v_text: torch.Tensor | None, v_img: torch.Tensor | None, text_scale: float,
           img_scale: float, renorm_min: float, renorm_type: str) -> torch.Tensor:
    """BAGEL's guidance of the full branch's velocity `v` by the no-text and no-image ones."""
    if v_text is None:
        return v
    mixed = v_text + text_scale * (v - v_text)
    if renorm_type == "text_channel":
        scale = (v.norm(dim=-1, keepdim=True) / (mixed.norm(dim=-1, keepdim=True) + 1e-8)).clamp(renorm_min, 1.0)
        mixed = mixed * scale
        return mixed if v_img is None else v_img + img_scale * (mixed - v_img)
    if v_img is not None:
        mixed = v_img + img_scale * (mixed - v_img)
    if renorm_type == "global":
        scale = (v.norm() / (mixed.norm() + 1e-8)).clamp(min=renorm_min, max=1.0)
    else:  # "channel"
        scale = (v.norm(dim=-1, keepdim=True) / (mixed.norm(dim=-1, keepdim=True) + 1e-8)).clamp(renorm_min, 1.0)
    return mixed * scale


def timesteps(steps: int, shift: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the times each step evaluates at, each step's dt): linspace(1, 0) shifted."""
    t = torch.linspace(1, 0, steps)
    t = shift * t / (1 + (shift - 1) * t)
    return t[:-1], t[:-1] - t[1:]


@dataclass
class Job:
    """One image's loop: its context (K/V of its `n` rows), size, latents and guidance."""

    full: KV
    n: int
    height: int
    width: int
    x: torch.Tensor
    steps: int = 50
    shift: float = 3.0
    text_scale: float = 3.0
    img_scale: float = 1.5
    interval: tuple[float, float] = (0.4, 1.0)
    renorm_min: float = 0.0
    renorm_type: str = "global"
    times: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    #: the full branch's query position (None: `n`, text-to-image's context rows) and the
    #: other branches' contexts and positions: text-to-image's by default (no text: empty;
    #: no image: the full one); an edit's (`bagel_edit`): its image alone, its text alone
    position: int | None = None
    notext: tuple[KV | None, int] = (None, 0)
    noimg: tuple[KV, int] | None = None

    def __post_init__(self) -> None:
        self.times = list(zip(*timesteps(self.steps, self.shift)))

    def queries(self, step: int, tags: torch.Tensor) -> list[Query]:
        """This step's branches: the full one, then (inside the interval) no text, no image."""
        t, size = float(self.times[step][0]), (self.height, self.width)
        full = (self.full, self.n if self.position is None else self.position)
        out = [Query(self.x, t, tags, *size, *full)]
        if self.interval[0] < t <= self.interval[1] and self.text_scale > 1.0:
            out.append(Query(self.x, t, tags, *size, *self.notext))
            if self.img_scale > 1.0:
                out.append(Query(self.x, t, tags, *size, *(self.noimg or full)))
        return out

    def advance(self, step: int, v: list[torch.Tensor]) -> None:
        """The guided velocity's Euler step (the branches `queries` gave, in order)."""
        v_text, v_img = (v[1], v[2] if len(v) > 2 else None) if len(v) > 1 else (None, None)
        mixed = guided(v[0], v_text, v_img, self.text_scale, self.img_scale, self.renorm_min, self.renorm_type)
        self.x = self.x - mixed * self.times[step][1].to(self.x.device)


def denoise(model: BagelGenerator, jobs: list[Job], tags: torch.Tensor) -> int:
    """Every job's loop in lockstep: each step one forward over every live job's branches.
    Returns the steps run (all jobs')."""
    done = 0
    for step in range(max((len(j.times) for j in jobs), default=0)):
        live = [j for j in jobs if step < len(j.times)]
        denoise_step(model, [(j, step) for j in live], tags)
        done += len(live)
    return done


def denoise_step(model: BagelGenerator, jobs: list[tuple[Job, int]], tags: torch.Tensor) -> None:
    """One iteration of each job, at its own step (`(job, step)`): one forward over every
    job's branches (the worker's runner runs a loop one iteration a worker step)."""
    queries = [j.queries(step, tags) for j, step in jobs]
    v = model.velocities([q for qs in queries for q in qs])
    at = 0
    for (job, step), qs in zip(jobs, queries):
        job.advance(step, v[at:at + len(qs)])
        at += len(qs)


def text_to_image(model: BagelGenerator, prompt_ids: torch.Tensor, tags: torch.Tensor, height: int, width: int,
                  noise: torch.Tensor, **options: Any) -> torch.Tensor:
    """The inferencer's text-to-image, uint8 [H, W, 3]: `prompt_ids` its
    `<|im_start|>text<|im_end|>`, `tags` [start_of_image, end_of_image], `noise` [h * w,
    patch dim], `options` `denoise`'s."""
    job = Job(model.context(prompt_ids), len(prompt_ids), height, width, noise, **options)
    denoise(model, [job], tags)
    return model.decode(job.x, height, width)
