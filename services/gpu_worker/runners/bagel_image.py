"""The runner of BAGEL's text-to-image (`shared.specs.bagel_image`): a request's context
into its pages in the step that takes it, then its denoising loop one iteration a step
(runners/loop_steps.py; DESIGN.md section 3, "Denoising loops"), as the Cosmos 3 runner
does (runners/diffusion.py, whose page helpers it shares).

The step that takes a request runs its context `<|im_start|>text<|im_end|>` through the
LLM's understanding weights once and writes every layer's K/V into the request's pages;
the loop then reads them back (read-only) for the full and the no-image branches at every
step, and the no-text branch reads an empty context. The reference keeps one `NaiveCache`
per branch and rebuilds the merged K/V (context + query) in every step and branch; here
the context is computed once and held in paged KV. Every live request runs an iteration
a step, each at its own: a step's iterations are one forward over every live request's
branches (projections and MLPs over all their rows at once, attention within each
branch): the GEMMs' row counts change their rounding, so an image is its reference's
within 1 (uint8), not bit for bit. The noise is the reference's `torch.randn(h * w, 64)`
on a CPU generator seeded with the request's seed, after `sample` earlier draws of the
same shape. The image goes back as float32 [1, H, W, 3] in [0, 1] (`Request.pooled`);
the route's PNG rounds x * 255 where the reference's PIL image truncates it.

An edit (tensors "vae_pixels", "vit_patches", "edit_text": `BagelImageSpec._edit_rows`)
builds its three branches' contexts (`modeling/vision/bagel_edit.py`) in the step that
takes it, writes the full one and then the text-alone one into its pages and reads them
back, the "no text" branch reading the full one's image rows (its prefix); its noise is
the encoder's Gaussian draw and then the latents', the reference's order.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from services.gpu_worker.modeling.vision.bagel_edit import edit_job
from services.gpu_worker.modeling.vision.bagel_gen import LATENT_PATCH, Job, denoise_step
from services.gpu_worker.request import LoopState, Request
from services.gpu_worker.runners.base import ModelRunner
from services.gpu_worker.runners.diffusion import DiffusionRunner
from services.gpu_worker.runners.loop_steps import iteration, state
from services.gpu_worker.step_types import PlanEntry
from shared.specs.image_gen import GEN_FIELDS


class BagelImageRunner(DiffusionRunner):
    def __init__(self, model, spec, kv, caches, planner=None) -> None:
        ModelRunner.__init__(self, model, spec, kv, caches, planner)
        self.denoise_steps = 0
        self.tags = torch.tensor(spec.tags, dtype=torch.long, device=self.device)

    def make_request(self, tensors: dict[str, np.ndarray]) -> tuple[list[int], dict]:
        """`tensors`: input_ids (the context's rows), gen (int64, `GEN_FIELDS`), guidance (float64)."""
        prompt, _ = ModelRunner.make_request(self, tensors)
        for name in ("gen", "guidance"):
            if name not in tensors:
                raise ValueError(f"a BAGEL image request needs tensor {name!r}")
        gen: dict[str, Any] = dict(zip(GEN_FIELDS, (int(v) for v in tensors["gen"].reshape(-1))))
        scales = tensors["guidance"].reshape(-1)
        gen["guidance"], gen["image_guidance"] = float(scales[0]), float(scales[-1])
        if "vae_pixels" in tensors:  # an edit: its input image (`BagelImageSpec._edit_rows`)
            gen["edit"] = (torch.from_numpy(np.array(tensors["vae_pixels"], dtype=np.float32)),
                           torch.from_numpy(np.array(tensors["vit_patches"], dtype=np.float32)),
                           int(tensors["edit_text"].reshape(-1)[0]))
        if not prompt or len(prompt) != gen["cond_rows"]:
            raise ValueError(f"a BAGEL image request's {len(prompt)} rows are not its context's {gen['cond_rows']}")
        return prompt, gen

    def start(self, entries: list[PlanEntry]) -> list[LoopState]:
        """Each entry's context into its pages; its loop: its job's steps (never past its cap)."""
        label = self.spec.label_name
        jobs = [self._image_job(e.request, e.pages[label]) for e in entries]
        return [LoopState(len(job.times), job) for job in jobs]

    def iterate(self, reqs: list[Request]) -> None:
        denoise_step(self.model, [(state(r), iteration(r)) for r in reqs], self.tags)
        self.denoise_steps += len(reqs)

    def result(self, req: Request) -> bytes:
        job = state(req)
        image = self.model.pixels(job.x, job.height, job.width)[None]
        return image.float().cpu().numpy().astype("<f4").tobytes()

    def _image_job(self, r: Any, pages: list[int]) -> Job:
        """Its context's K/V into its pages, read back (read-only from here on); its noise."""
        gen = r.inputs
        steps = min(gen["steps"], int(r.caps.get(self.spec.denoise_loop, 0)) + 1)
        if "edit" in gen:
            return self._edit_job(r, pages, steps)
        ids = torch.tensor(r.prompt, dtype=torch.long, device=self.device)
        self._write(pages, 0, self.model.context(ids))
        return Job(self._read(pages, 0, len(r.prompt)), len(r.prompt), gen["height"], gen["width"],
                   self._noise(gen), steps=steps, text_scale=gen["guidance"], img_scale=gen["image_guidance"])

    def _edit_job(self, r: Any, pages: list[int], steps: int) -> Job:
        """An edit's three contexts (`bagel_edit`) into its pages (the full one, then the
        text alone), read back: the "no text" branch reads the full one's image rows."""
        gen = r.inputs
        pixels, patches, text = gen["edit"]
        ids = torch.tensor(r.prompt[-text:], dtype=torch.long, device=self.device)
        enc_noise, noise = self._edit_noise(gen)
        job = edit_job(self.model, pixels.to(self.device), enc_noise, patches.to(self.device), ids, self.tags, noise,
                       steps=steps, text_scale=gen["guidance"], img_scale=gen["image_guidance"])
        image = job.n - text
        self._write(pages, 0, job.full)
        assert job.noimg is not None
        self._write(pages, job.n, job.noimg[0])
        job.full, job.notext = self._read(pages, 0, job.n), (self._read(pages, 0, image), job.notext[1])
        job.noimg = (self._read(pages, job.n, text), job.noimg[1])
        return job

    def _edit_noise(self, gen: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the encoder's Gaussian noise [1, C, H / 8, W / 8], the latents' [h * w, 2 * 2 * C]):
        the reference's draws in its order, after `sample` earlier edits' draws."""
        down, c = self.model.downsample, self.model.latent_channels
        enc = (1, c, gen["height"] * LATENT_PATCH // down, gen["width"] * LATENT_PATCH // down)
        shape = ((gen["height"] // down) * (gen["width"] // down), LATENT_PATCH**2 * c)
        generator = torch.Generator("cpu").manual_seed(gen["seed"])
        for _ in range(gen["sample"]):
            torch.randn(enc, generator=generator)
            torch.randn(shape, generator=generator)
        enc_noise = torch.randn(enc, generator=generator).to(self.device)
        return enc_noise, torch.randn(shape, generator=generator).to(self.device, self.model.dtype_())

    def _noise(self, gen: dict[str, Any]) -> torch.Tensor:
        """[h * w, 2 * 2 * C]: the reference's draw, after `sample` earlier ones."""
        down = self.model.downsample
        shape = ((gen["height"] // down) * (gen["width"] // down), LATENT_PATCH**2 * self.model.latent_channels)
        generator = torch.Generator("cpu").manual_seed(gen["seed"])
        for _ in range(gen["sample"]):
            torch.randn(shape, generator=generator)
        return torch.randn(shape, generator=generator).to(self.device, self.model.dtype_())
