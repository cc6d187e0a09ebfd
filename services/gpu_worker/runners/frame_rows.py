"""The step of a speech backbone whose rows are text tokens or audio frames (CSM, Higgs
Audio): one module, because both gather a step's rows the same way (a prompt chunk's text
ids, its context clips' frame codes at their positions, a decode row's last frame) and
differ only in how a sampling row's hidden state becomes the next frame."""

from __future__ import annotations

import numpy as np
import torch

from services.gpu_worker.attention import AttnRows
from services.gpu_worker.request import Request
from services.gpu_worker.runners.base import ModelRunner
from services.gpu_worker.step_types import PlanEntry, StepPlan
from shared.layout import KVLabel


class StepRows:
    """A step's backbone rows as they are gathered: text rows (ids) and frame rows (codes)."""

    def __init__(self) -> None:
        self.text_ids: list[int] = []
        self.text_rows: list[int] = []
        self.frames: list[list[int]] = []
        self.frame_rows: list[int] = []
        self.positions: list[int] = []
        #: vectors added to prompt rows (Qwen3-TTS' x-vectors), and their rows
        self.vectors: list[torch.Tensor] = []
        self.vector_rows: list[int] = []
        #: each frame row's text id (Qwen3-TTS' talker adds its projection; None: the model's own)
        self.frame_texts: list[int | None] = []
        self.t = 0

    def text(self, tokens: list[int]) -> None:
        self.text_ids.extend(tokens)
        self.text_rows.extend(range(self.t, self.t + len(tokens)))
        self.t += len(tokens)

    def frame(self, codes: list[int], text: int | None = None) -> None:
        self.frames.append(codes)
        self.frame_rows.append(self.t)
        self.frame_texts.append(text)
        self.t += 1


class FrameBackboneRunner(ModelRunner):
    """`execute` for a backbone over text and frame rows. A subclass sets `backbone_label`
    and turns the sampling rows' hidden states into frames in `_sample_frames`."""

    backbone_label: KVLabel

    def _sample_frames(self, hidden: torch.Tensor, entries: list[PlanEntry]) -> list[int]:
        """Each sampling entry's next frame from its backbone `hidden` row, kept on the
        request; returns each one's token."""
        raise NotImplementedError

    def execute(self, plan: StepPlan) -> list[list[int]]:
        label = self.backbone_label.name
        rows, sampled, sample_rows = [], [], []
        step = StepRows()
        for e in plan.entries:
            r, n = e.request, e.rows
            rows.append(AttnRows(e.pages[label], r.kv.labels[label].first_page, r.num_computed, n, e.decode))
            if e.decode:
                step.frame(r.inputs["last_frame"], self._decode_text(r))
            else:
                self._prompt_rows(r, n, step)
            step.positions.extend(range(r.num_computed, r.num_computed + n))
            if r.num_computed + n == r.tokens_len:
                sampled.append(e)
                sample_rows.append(step.t - 1)
        meta = self._metadata({label: rows})[label]

        def long(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        extra = {"vectors": torch.stack(step.vectors), "vector_rows": long(step.vector_rows)} if step.vectors else {}
        if any(t is not None for t in step.frame_texts):
            extra["frame_texts"] = long(step.frame_texts)
        with torch.inference_mode():
            hidden = self.model.backbone(long(step.text_ids), long(step.text_rows),
                                         long(step.frames).view(-1, self.spec.num_codebooks), long(step.frame_rows),
                                         long(step.positions), self.layer_caches, meta, **extra)
            made = self._sample_frames(hidden[long(sample_rows)], sampled) if sampled else []
        tokens = {id(e): tok for e, tok in zip(sampled, made)}
        return [[tokens[id(e)]] if id(e) in tokens else [] for e in plan.entries]

    def _decode_text(self, r: Request) -> int | None:
        """The text id a decoding request's frame row adds (Qwen3-TTS'); None: none."""
        return None

    def _prompt_rows(self, r: Request, n: int, step: StepRows) -> None:
        """A prompt chunk's `n` rows: text ids, except the context's frame rows (kept on
        `r.embeds` by `prepare` as (positions, codes), dropped once the chunk holding the
        last of them runs)."""
        lo, hi = r.num_computed, r.num_computed + n
        frames: dict[int, list[int]] = {}
        if r.embeds is not None:
            where, codes = r.embeds
            a, b = np.searchsorted(where, [lo, hi])
            frames = dict(zip(where[a:b].tolist(), codes[a:b].tolist()))
            if b == len(where):
                r.embeds = None
        if not frames:  # a text chunk (every prompt without context audio)
            step.text(r.prompt[lo:hi])
            return
        for pos in range(lo, hi):
            if pos in frames:
                step.frame(frames[pos])
            else:
                step.text([r.prompt[pos]])
