"""The runner hooks of a vision-language model: images in, text out.

The step loop, admission, footprints and the prefix cache are the decoder's; what differs
is where an image token's row comes from:

1. at admission (`prepare`, at most `MAX_ENCODES_PER_STEP` requests a step, so running
   streams are not held up by a burst of images): the vision tower runs on the request's
   tiles, and their rows are kept on the request (`Request.embeds`, prompt positions and
   values). Tiles whose rows the prefix cache already holds (the same image earlier, its
   rows keyed by the image's hash: `shared.specs.vision_lm`) are not encoded at all;
2. prefill (chunked or not, batched with other requests): the rows of the step that are
   image tokens take the kept rows in place of the placeholder's embedding; once a
   request's last image row is computed, its kept rows are dropped;
3. decode is the text model's.

Nothing is written into KV at admission, so `admission_rows` stays empty: the image rows
are ordinary prompt rows of the "text" label, committed by the prefill that computes them.

Where the layout marks image rows bidirectional (Gemma 3: `Span.bidirectional`, gathered
in `RequestKV.blocks`), each prefill chunk's attention rows carry the blocks among its
rows, so their mask lets a block's rows see each other both ways (the scheduler never
splits a block between chunks). FlashInfer's plan is causal only, so a step with such a
chunk is built for the torch path instead (on CUDA too).
"""

from __future__ import annotations

import contextlib
import logging
import os

import numpy as np
import torch

from services.gpu_worker.attention import BUILDERS, AttnMetadata, AttnRows
from services.gpu_worker.request import Request
from services.gpu_worker.runners.base import ModelRunner
from services.gpu_worker.step_types import Failure, StepPlan
from services.gpu_worker.threads import torch_threads
from shared.cgroup import available_cpus
from shared.specs.base import VisionRunnerSpec

log = logging.getLogger("mstar.vision_runner")

#: requests whose images are encoded in one step at most
MAX_ENCODES_PER_STEP = 4


@contextlib.contextmanager
def all_cores(device: torch.device):
    """The vision tower on every core the worker may use: torch computes it (not the C
    kernels), and the worker leaves torch one core fewer so the other services keep one;
    while it encodes, nothing else of the step runs (measured: a one-image TTFT 0.65x
    transformers' on one thread, 1.0x on two; decode keeps its own threads). An explicit
    MSTAR_TORCH_THREADS is left as it is."""
    if device.type != "cpu" or os.environ.get("MSTAR_TORCH_THREADS"):  # an operator's setting stands
        yield
        return
    with torch_threads(max(torch.get_num_threads(), available_cpus())):
        yield


class VisionRunner(ModelRunner):
    needs_prepare = True
    SPEC = VisionRunnerSpec

    def __init__(self, model, spec, kv, caches: dict[str, list[torch.Tensor]], planner=None) -> None:
        super().__init__(model, spec, kv, caches, planner)
        self.image_token_id = int(spec.image_token_id)
        self.rows_per_tile = int(spec.rows_per_tile)
        self.dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        #: the plan `execute` runs, while it runs (for `_metadata`)
        self._plan: StepPlan | None = None

    def make_request(self, tensors: dict[str, np.ndarray]) -> tuple[list[int], dict]:
        """`tensors`: "input_ids" int [P], and "pixel_values" float [tiles, C, H, W] when
        the prompt holds images (`VisionLMSpec.process_prompt`)."""
        prompt, _ = super().make_request(tensors)
        where = np.flatnonzero(np.asarray(prompt) == self.image_token_id)
        pixels = tensors.get("pixel_values")
        tiles = 0 if pixels is None else pixels.shape[0]
        if len(where) != tiles * self.rows_per_tile:
            raise ValueError(f"the prompt holds {len(where)} image tokens; its {tiles} tile(s) make "
                             f"{tiles * self.rows_per_tile} rows")
        if pixels is None:
            return prompt, {}
        return prompt, {"pixels": torch.from_numpy(np.ascontiguousarray(pixels, dtype=np.float32)),
                        "where": where}

    def prepare(self, admitted: list[Request], pages: dict[str, dict[str, list[int]]]) -> list[Failure]:
        """Encode the tiles of newly admitted requests whose rows are still to compute."""
        todo = [r for r in admitted if r.inputs.get("pixels") is not None]
        try:
            with all_cores(self.device):
                self._encode(todo)
        except Exception as exc:
            log.exception("the vision tower failed on %d request(s)", len(todo))
            return [Failure(r, "internal error in the vision tower", exc) for r in todo]
        return []

    def _encode(self, reqs: list[Request]) -> None:
        """One tower pass over every needed tile of `reqs`; each request keeps the rows of
        its needed tiles and their prompt positions."""
        batch, keep = [], []
        for r in reqs:
            where: np.ndarray = r.inputs["where"]
            last = where.reshape(-1, self.rows_per_tile)[:, -1]
            needed = np.flatnonzero(last >= r.num_computed)  # tiles the prefix cache does not hold
            keep.append((r, needed))
            if len(needed):
                batch.append(r.inputs["pixels"][torch.from_numpy(needed)])
        if not batch:
            return
        with torch.inference_mode():
            rows = self.model.encode_images(torch.cat(batch).to(self.device, self.dtype))
        start = 0
        for r, needed in keep:
            if not len(needed):
                continue
            n = len(needed) * self.rows_per_tile
            where = r.inputs["where"].reshape(-1, self.rows_per_tile)[needed].reshape(-1)
            r.embeds = (where, rows[start : start + n])
            start += n

    def execute(self, plan: StepPlan) -> list[list[int]]:
        """The decoder's step; the plan is kept for `_metadata` (which sees only rows)."""
        self._plan = plan
        try:
            return super().execute(plan)
        finally:
            self._plan = None

    def _metadata(self, rows: dict[str, list[AttnRows]]) -> dict[str, AttnMetadata]:
        """The decoder's metadata, with each prefill chunk's bidirectional blocks on its
        attention rows (`rows[label][i]` is the plan's entry i); on CUDA a step with blocks
        is built for the torch path (FlashInfer's plan is causal only)."""
        entries = self._plan.entries if self._plan is not None else []
        blocks = [() if e.decode else _chunk_blocks(e.request.kv.blocks, e.request.num_computed, e.rows)
                  for e in entries]
        if not any(blocks):
            return super()._metadata(rows)
        with_blocks = {name: [r._replace(blocks=b) for r, b in zip(label_rows, blocks)]
                       for name, label_rows in rows.items()}
        if self.planner is None:
            return super()._metadata(with_blocks)
        metas = {name: BUILDERS["torch"].build(r, self.page_sizes[name], self.windows[name])
                 for name, r in with_blocks.items()}
        return {name: m.to(self.device) for name, m in metas.items()}

    def call_model(self, ids, positions, metas: dict[str, AttnMetadata], sample_rows, plan: StepPlan) -> torch.Tensor:
        return self.model(ids, positions, self.layer_caches, [metas[name] for name in self.spec.layer_labels],
                          sample_rows, self._step_embeds(plan))

    def _step_embeds(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The image rows among this step's rows (their flat indices and values); a
        request's kept rows are dropped once the chunk holding its last one runs."""
        index: list[np.ndarray] = []
        values: list[torch.Tensor] = []
        t = 0
        for e in plan.entries:
            r = e.request
            if r.embeds is not None and not e.decode:
                where, rows = r.embeds
                lo, hi = np.searchsorted(where, [r.num_computed, r.num_computed + e.rows])
                if hi > lo:
                    index.append(where[lo:hi] - r.num_computed + t)
                    values.append(rows[lo:hi])
                if hi == len(where):
                    r.embeds = None
            t += e.rows
        if not index:
            return None
        return torch.from_numpy(np.concatenate(index)).to(self.device), torch.cat(values)


def _chunk_blocks(blocks: tuple[tuple[int, int], ...], start: int, n: int) -> tuple[tuple[int, int], ...]:
    """The blocks with rows among a chunk's rows [start, start + n)."""
    return tuple(b for b in blocks if b[0] < start + n and b[1] > start)
