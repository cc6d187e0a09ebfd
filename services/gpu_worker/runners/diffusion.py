"""The runner of text-to-image/video diffusion models (Cosmos 3): a request's prompts into
paged KV in the step that takes it, then its denoising loop, one iteration a step
(runners/loop_steps.py; DESIGN.md section 3, "Denoising loops").

A request's rows are its conditional prompt's and, under classifier-free guidance, its
unconditional prompt's (two row sets of one label, `Cosmos3Spec.process_prompt`). The step
that takes it runs the text pathway once per row set and writes every layer's text K/V
into the request's pages; then the `denoise_loop` (the request's `num_inference_steps`,
never past its cap) runs one iteration a step over every live request together, each at
its own iteration: one forward of the latents' patch rows of every live row set (a request
under CFG has two: the same latents at the two prompts' positions), each reading its
prompt's K/V gathered once from the pages, read-only, and its own timestep; then each
request's guidance (uncond + g * (cond - uncond), float32) and its own UniPC scheduler
step (modeling/diffusion/unipc.py, one per request: its multistep history is the
request's, carried on it from step to step). The reference recomputes the whole text
pathway in every step and branch; here it runs once per request. Each iteration sends the
request's progress (a video job's `progress`).

The noise is drawn here, where torch is: the pipeline's `randn_tensor(shape, generator)`
for a CPU generator seeded with the request's seed, after `sample` earlier draws of the
same shape (the j-th of n samples is the pipeline's j-th call on one generator). The
decoded frames go back as bytes on the request (`Request.pooled`: [F, H, W, 3]; float32
for an image, uint8 for a video: `frame_bytes`).
`denoise_steps` counts the iterations run (every request's), for /metrics.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from services.gpu_worker.modeling.diffusion.unipc import UniPC, check_config
from services.gpu_worker.request import LoopState, Request
from services.gpu_worker.runners.loop_steps import LoopStepsRunner, iteration, state
from services.gpu_worker.step_types import PlanEntry
from shared.specs.base import DeploymentError, DiffusionRunnerSpec
from shared.specs.image_gen import GEN_FIELDS

log = logging.getLogger("mstar.diffusion_runner")


@dataclass
class Job:
    """One request's loop: its latents, its scheduler, its row sets' positions and K/V."""

    gen: dict[str, Any]
    latents: torch.Tensor
    scheduler: UniPC
    ropes: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    text: list[list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)


def frame_bytes(frames: torch.Tensor, num_frames: int) -> bytes:
    """An image's float32 bytes (the api may send the float image); a video's uint8 ones,
    rounded as diffusers' `numpy_to_pil` rounds (a quarter of the bytes: a 720p clip of
    189 frames is 0.5 GB so, not 2)."""
    if num_frames == 1:
        return frames.cpu().numpy().astype("<f4").tobytes()
    return (frames * 255).round().to(torch.uint8).cpu().numpy().tobytes()


class DiffusionRunner(LoopStepsRunner):
    SPEC = DiffusionRunnerSpec
    reports_progress = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scheduler_config = self.spec.config.get("scheduler") or {}
        try:
            check_config(self.scheduler_config)
        except ValueError as exc:
            raise DeploymentError(str(exc)) from exc
        self.denoise_steps = 0
        tcfg = self.spec.config["transformer"]
        self.patch, self.channels = int(tcfg.get("latent_patch_size", 2)), int(tcfg["latent_channel"])
        self.fps_positions = bool(tcfg.get("enable_fps_modulation", True))
        self.margin = int(tcfg.get("unified_3d_mrope_temporal_modality_margin", 15000))
        self.base_fps = float(tcfg.get("base_fps", 24))

    def _layer_caches(self) -> list[torch.Tensor]:
        return list(self.caches[self.spec.label(self.spec.label_name).pool])

    def attention_shape(self) -> tuple[int, float | None]:
        return self.spec.heads, None

    def make_request(self, tensors: dict[str, np.ndarray]) -> tuple[list[int], dict]:
        """`tensors`: input_ids (the prompts' rows), gen (int64, `GEN_FIELDS`), guidance (float64)."""
        prompt, _ = super().make_request(tensors)
        for name in ("gen", "guidance"):
            if name not in tensors:
                raise ValueError(f"a diffusion request needs tensor {name!r}")
        gen: dict[str, Any] = dict(zip(GEN_FIELDS, (int(v) for v in tensors["gen"].reshape(-1))))
        gen["guidance"] = float(tensors["guidance"].reshape(-1)[0])
        if len(prompt) <= gen["cond_rows"] if gen["cfg"] else len(prompt) != gen["cond_rows"]:
            raise ValueError(f"a diffusion request's {len(prompt)} rows do not hold its prompts "
                             f"({gen['cond_rows']} conditional rows, CFG {'on' if gen['cfg'] else 'off'})")
        return prompt, gen

    def start(self, entries: list[PlanEntry]) -> list[LoopState]:
        """Each entry's prompts into its pages; its loop: its steps, never past its cap."""
        label = self.spec.label_name
        out = []
        for e in entries:
            job = self._job(e.request, e.pages[label])
            out.append(LoopState(min(job.gen["steps"], int(e.request.caps.get(self.spec.denoise_loop, 0))), job))
        return out

    def result(self, req: Request) -> bytes:
        job = state(req)
        return frame_bytes(self.model.decode(job.latents), job.gen["num_frames"])

    # -- a request's set-up ---------------------------------------------------------

    def _job(self, req: Any, pages: list[int]) -> Job:
        """Its row sets' K/V computed and written to its pages, then read back (read-only
        from here on); its noise; its scheduler."""
        gen = req.inputs
        c = gen["cond_rows"]
        sets = [(0, c), (c, len(req.prompt) - c)] if gen["cfg"] else [(0, c)]
        ids = torch.tensor(req.prompt, dtype=torch.long, device=self.device)
        for first, rows in sets:
            positions = torch.arange(rows, dtype=torch.float32, device=self.device).expand(3, rows)
            self._write(pages, first, self.model.text_kv(ids[first:first + rows], positions))
        latents = self._noise(gen)
        job = Job(gen, latents, UniPC(self.scheduler_config, gen["steps"], self.device))
        for first, rows in sets:
            job.text.append(self._read(pages, first, rows))
            job.ropes.append(self.model.rope(self._latent_positions(latents.shape, rows + self.margin)))
        return job

    def _noise(self, gen: dict[str, Any]) -> torch.Tensor:
        """[1, C, T, h, w] float32: the pipeline's draw, after `sample` earlier ones."""
        t = (gen["num_frames"] - 1) // self.spec.temporal + 1
        vae_spatial = self.spec.spatial // self.patch
        shape = (1, self.channels, t, gen["height"] // vae_spatial, gen["width"] // vae_spatial)
        generator = torch.Generator("cpu").manual_seed(gen["seed"])
        for _ in range(gen["sample"]):
            torch.randn(shape, generator=generator, dtype=torch.float32)
        return torch.randn(shape, generator=generator, dtype=torch.float32).to(self.device)

    def _latent_positions(self, shape: torch.Size, offset: int) -> torch.Tensor:
        """The latents' patch rows' 3-axis positions [3, rows] (`get_3d_mrope_ids_vae_tokens`
        with spatial indices reset): frames from `offset`, rescaled by fps for a video."""
        _, _, t, h, w = shape
        gh, gw = -(-h // self.patch), -(-w // self.patch)
        frames = torch.arange(t, dtype=torch.float32)
        if self.fps_positions and t > 1:  # fps 24 (the pipeline's default), tps = fps / temporal
            tcf = self.spec.temporal
            frames = frames / (24.0 / tcf) * (self.base_fps / tcf) + offset
        else:
            frames = frames + offset
        tt = frames.view(-1, 1).expand(-1, gh * gw).flatten()
        hh = torch.arange(gh).view(1, -1, 1).expand(t, -1, gw).flatten().float()
        ww = torch.arange(gw).view(1, 1, -1).expand(t, gh, -1).flatten().float()
        return torch.stack([tt, hh, ww]).to(self.device)

    # -- the loop ----------------------------------------------------------------------

    def iterate(self, reqs: list[Request]) -> None:
        """One iteration of each request (its own timestep), every live row set in one forward."""
        jobs = [(state(r), iteration(r)) for r in reqs]
        tokens, times, ropes, sets, text = [], [], [], [], []
        at = 0
        for job, step in jobs:
            patches = self._patchify(job.latents)
            t = job.scheduler.timesteps[step]
            for rope, kv in zip(job.ropes, job.text):
                tokens.append(patches)
                times.append(torch.full((patches.shape[0],), t.item(), device=self.device))
                ropes.append(rope)
                sets.append((at, patches.shape[0]))
                text.append(kv)
                at += patches.shape[0]
        v = self.model.velocity(torch.cat(tokens), torch.cat(times), ropes, sets, text).float()
        s = 0
        for job, _ in jobs:
            first, rows = sets[s]
            cond = self._unpatchify(v[first:first + rows], job.latents.shape)
            if job.gen["cfg"]:
                first, rows = sets[s + 1]
                uncond = self._unpatchify(v[first:first + rows], job.latents.shape)
                cond = uncond + job.gen["guidance"] * (cond - uncond)
            s += len(job.ropes)
            job.latents = job.scheduler.step(cond.unsqueeze(0), job.latents.unsqueeze(0)).squeeze(0)
        self.denoise_steps += len(jobs)
        log.debug("diffusion step: %d request(s) at iterations %s", len(jobs), [step for _, step in jobs])

    def _patchify(self, latents: torch.Tensor) -> torch.Tensor:
        """[1, C, T, h, w] -> patch rows [T * h/p * w/p, p * p * C] (`_patchify_and_pack_latents`)."""
        p = self.patch
        _, c, t, h, w = latents.shape
        x = latents[0].reshape(c, t, h // p, p, w // p, p)
        return torch.einsum("cthpwq->thwpqc", x).reshape(-1, p * p * c)

    def _unpatchify(self, rows: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        p = self.patch
        _, c, t, h, w = shape
        x = rows.reshape(t, h // p, w // p, p, p, c)
        return torch.einsum("thwpqc->cthpwq", x).reshape(c, t, h, w).unsqueeze(0)

    # -- the pages ---------------------------------------------------------------------

    def _slots(self, pages: list[int], first: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        size = self.page_sizes[self.spec.label_name]
        at = torch.arange(first, first + rows)
        table = torch.tensor(pages, dtype=torch.long)
        return table[at // size].to(self.device), (at % size).to(self.device)

    def _write(self, pages: list[int], first: int, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """A row set's K and V (each layer's [rows, kv heads, head_dim]) at its rows."""
        pg, sl = self._slots(pages, first, kv[0][0].shape[0])
        for cache, (k, v) in zip(self.layer_caches, kv):
            cache[pg, 0, sl] = k.to(cache.dtype)
            cache[pg, 1, sl] = v.to(cache.dtype)

    def _read(self, pages: list[int], first: int, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        pg, sl = self._slots(pages, first, rows)
        dtype = self.model.dtype_()
        return [(cache[pg, 0, sl].to(dtype), cache[pg, 1, sl].to(dtype)) for cache in self.layer_caches]
