"""BAGEL's edit context: an input image and the prompt, as its `InterleaveInferencer`
builds them for `interleave_inference([image, text])` (op for op: `update_context_image`
with vae and vit, then `update_context_text`).

The full context, in order:
- the image's autoencoder block (`forward_cache_update_vae`): `<|vision_start|>`, one row
  per 2 x 2 patch of the image's clean latents (`FluxEncoder.encode` with the Gaussian's
  noise drawn first on the request's generator), `<|vision_end|>`; a latent row's input is
  `vae2llm(z) + time_embedder(0) + latent_pos_embed`, through the generation weights, the
  tags through the understanding ones; all at RoPE position 0, attending both ways;
- the image's ViT block (`forward_cache_update_vit`): the tags around the ViT's rows
  (SigLIP, the connector, the sin-cos table), understanding weights, position 1, both ways
  and to the block before;
- the text `<|im_start|>prompt<|im_end|>`, causal, positions 2, 3, ...
The "no text" branch's context is the first two blocks (the inferencer copies the context
before the text: a prefix of the full one, its query at position 2); the "no image"
branch's is the text alone from position 0 (it never sees the image). The edit's output
is the input's size after the VAE transform's resize.
"""

from __future__ import annotations

from typing import Any

import torch

from services.gpu_worker.modeling.vision.bagel import MAX_PATCHES_PER_SIDE
from services.gpu_worker.modeling.vision.bagel_gen import KV, LATENT_PATCH, BagelGenerator, Job


def _cat(*kvs: KV) -> KV:
    return [(torch.cat([kv[i][0] for kv in kvs]), torch.cat([kv[i][1] for kv in kvs])) for i in range(len(kvs[0]))]


def latents(model: BagelGenerator, pixels: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The image [3, H, W] in [-1, 1] -> its sampled latents as rows [h * w, 2 * 2 * C]
    (`forward_cache_update_vae`'s patchify, "chpwq->hwpqc")."""
    weights = model.vae_encoder.encoder.conv_in.weight
    z = model.vae_encoder.encode(pixels[None].to(weights.device, weights.dtype), noise).to(model.dtype_())[0]
    c, p = model.latent_channels, LATENT_PATCH
    h, w = z.shape[1] // p, z.shape[2] // p
    return torch.einsum("chpwq->hwpqc", z.reshape(c, h, p, w, p)).reshape(h * w, p * p * c)


def vit_rows(model: BagelGenerator, patches: torch.Tensor) -> torch.Tensor:
    """ViT patches [h, w, D] -> the image's LLM rows [h * w, hidden] (as understanding's)."""
    h, w, _ = patches.shape
    dev = patches.device
    ids = (torch.arange(h, device=dev)[:, None] * MAX_PATCHES_PER_SIDE + torch.arange(w, device=dev)).reshape(-1)
    x = model.connector(model.vit(patches.reshape(h * w, -1).to(model.dtype_()), ids))
    return x + model.vit_pos_embed.pos_embed[ids]


def image_context(model: BagelGenerator, pixels: torch.Tensor, noise: torch.Tensor, patches: torch.Tensor,
                  tags: torch.Tensor) -> KV:
    """The image's two blocks' K/V (the "no text" branch's context: module docstring)."""
    lm = model.language_model
    embedded = lm.model.embed_tokens(tags)
    down = model.downsample
    seq, gen, pos = model.latent_block(latents(model, pixels, noise), 0.0, embedded, pixels.shape[1] // down,
                                       pixels.shape[2] // down, 0)
    vae = lm.run(seq, gen, pos, [(0, len(seq))], [None], causal=False)[1]
    rows = torch.cat((embedded[:1], vit_rows(model, patches), embedded[1:]))
    und = torch.zeros(len(rows), dtype=torch.bool, device=rows.device)
    vit = lm.run(rows, und, torch.ones(len(rows), dtype=torch.long, device=rows.device), [(0, len(rows))], [vae],
                 causal=False)[1]
    return _cat(vae, vit)


def text_context(model: BagelGenerator, ids: torch.Tensor, past: KV | None, position: int) -> KV:
    """The text's K/V after `past` (None: from nothing), causal, from RoPE `position`."""
    lm = model.language_model
    und = torch.zeros(len(ids), dtype=torch.bool, device=ids.device)
    positions = torch.arange(position, position + len(ids), device=ids.device)
    return lm.run(lm.model.embed_tokens(ids), und, positions, [(0, len(ids))], [past], causal=True)[1]


def edit_job(model: BagelGenerator, pixels: torch.Tensor, enc_noise: torch.Tensor, patches: torch.Tensor,
             text_ids: torch.Tensor, tags: torch.Tensor, noise: torch.Tensor, **options: Any) -> Job:
    """An edit's loop: its three branches' contexts (module docstring) and its noise."""
    image = image_context(model, pixels, enc_noise, patches, tags)
    rows = len(image[0][0])
    full = _cat(image, text_context(model, text_ids, image, 2))
    noimg = text_context(model, text_ids, None, 0)
    return Job(full, rows + len(text_ids), pixels.shape[1], pixels.shape[2], noise, position=2 + len(text_ids),
               notext=(image, 2), noimg=(noimg, len(text_ids)), **options)
