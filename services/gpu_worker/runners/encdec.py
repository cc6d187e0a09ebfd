"""The runner hooks of an encoder-decoder model (Whisper): audio in, text out.

The step loop, admission, footprints and stop checks are the decoder's; what differs is
the request's walk:

1. at admission (at most `MAX_ENCODES_PER_STEP` a step, so running requests' next token
   is not held up by a burst of encodes): run the encoder on the request's features and
   write each decoder layer's cross K/V of the frames into the "cross" label's pages (the
   scheduler reserves them, `admission_rows`, and commits them as its one span); only
   then is the request ready to schedule;
2. for a request whose metadata says `detect_language` (no language sent, none the
   model's default): the language probe, batched across the step's admitted requests,
   as transformers' `detect_language`: the decoder on <|startoftranscript|> alone, its
   row written into the "self" label's scratch (`scratch_rows`: reserved by the scheduler
   past the committed rows, none yet, and given back after the probe), the argmax of the
   logits over the language tokens (no suppress lists). The detected token goes in at
   index 1 of the prompt, and the language is reported with the first output;
3. prefill of the forced decoder prompt on "self" (its `rows` span), which samples the
   first token;
4. one decode row per step on "self" (growth on "decode_loop"), batched across requests,
   attending over its own "self" pages and over its "cross" pages.

The generation config's `suppress_tokens` (every step) and `begin_suppress_tokens` (first
token) are applied to the logits, as transformers' Whisper generate does.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from services.gpu_worker.attention import AttnMetadata, AttnRows, CrossRows
from services.gpu_worker.request import Request
from services.gpu_worker.runners.base import ModelRunner
from services.gpu_worker.step_types import Failure, StepPlan
from shared.layout import KVLabel
from shared.specs.base import EncoderDecoderRunnerSpec

log = logging.getLogger("mstar.encdec_runner")

#: encoder passes in one step at most
MAX_ENCODES_PER_STEP = 4


class EncoderDecoderRunner(ModelRunner):
    needs_prepare = True
    SPEC = EncoderDecoderRunnerSpec

    def __init__(self, model, spec, kv, caches: dict[str, list[torch.Tensor]], planner=None) -> None:
        self.self_label, self.cross_label = spec.label(spec.self_label), spec.label(spec.cross_label)
        super().__init__(model, spec, kv, caches, planner)
        self.self_caches = caches[self.self_label.pool]
        self.cross_caches = caches[self.cross_label.pool]
        self.n_frames = spec.n_frames
        self.suppress = torch.tensor(sorted(spec.suppress_tokens), dtype=torch.long)
        self.begin_suppress = torch.tensor(sorted(spec.begin_suppress_tokens), dtype=torch.long)
        self.dtype = next(model.parameters()).dtype
        self.language_ids = torch.tensor(spec.language_ids(), dtype=torch.long)

    def _layer_caches(self) -> list[torch.Tensor]:
        return []  # the model takes its "self" and "cross" pools whole

    def attention_shape(self) -> tuple[int, float | None]:
        return self.caches[self.self_label.pool][0].shape[3], None  # multi-head: a KV head per query head

    @property
    def step_labels(self) -> tuple[KVLabel, ...]:
        return (self.self_label,)  # the cross rows are written once, at admission

    def make_request(self, tensors: dict[str, np.ndarray]) -> tuple[list[int], dict]:
        """`tensors`: "input_features" float [1, n_mels, 2 * n_frames] and
        "decoder_input_ids" int [P] (what `WhisperSpec.process_prompt` makes; without the
        language token when the request detects it)."""
        missing = sorted({"input_features", "decoder_input_ids"} - set(tensors))
        if missing:
            raise ValueError(f"an encoder-decoder request needs tensors {missing}")
        feats = torch.from_numpy(np.ascontiguousarray(tensors["input_features"], dtype=np.float32))
        if feats.dim() == 2:
            feats = feats.unsqueeze(0)
        want = (1, self.spec.n_mels, self.spec.input_frames)
        if tuple(feats.shape) != want:
            raise ValueError(f"input_features must be {list(want)}, got {list(feats.shape)}")
        prompt = [int(t) for t in np.asarray(tensors["decoder_input_ids"]).reshape(-1)]
        if not prompt:
            raise ValueError("the decoder prompt is empty")
        return prompt, {"features": feats}

    def check_layout(self, labels: set[str]) -> None:
        want = {self.self_label.name, self.cross_label.name}
        if labels != want:
            raise ValueError(f"an encoder-decoder request needs layouts for labels {sorted(want)}")

    def admission_rows(self, req: Request) -> dict[str, int]:
        return {self.cross_label.name: self.n_frames}

    def prepare(self, admitted: list[Request], pages: dict[str, dict[str, list[int]]]) -> list[Failure]:
        """Encode the newly admitted requests into their reserved cross pages; returns
        those that failed (the engine fails them, with their pages)."""
        # the cross label is never keyed: a prefix-cache hit here is a bug
        failed = [Failure(r, "internal error",
                          ValueError(f"{r.num_computed} prefix-cache rows on an encoder-decoder request"))
                  for r in admitted if r.num_computed]
        todo = [r for r in admitted if not r.num_computed]
        if not todo:
            return failed
        rows = [AttnRows(pages[r.request_id][self.cross_label.name], 0, 0, self.n_frames, False) for r in todo]
        try:
            self._encode(todo, rows)
        except Exception as exc:
            log.exception("the encoder failed on %d request(s)", len(todo))
            return failed + [Failure(r, "internal error in the encoder", exc) for r in todo]
        for r in todo:
            if not r.metadata.get("detect_language") and isinstance(r.metadata.get("language"), str):
                r.report = {"language": r.metadata["language"]}  # the language its prompt names
        return failed

    def scratch_rows(self, req: Request) -> dict[str, int]:
        return {self.self_label.name: self.spec.probe_rows} if req.metadata.get("detect_language") else {}

    def probe(self, reqs: list[Request], pages: dict[str, dict[str, list[int]]]) -> list[Failure]:
        """Put each detecting request's language token into its prompt (step 2 of the
        module docstring)."""
        name = self.self_label.name
        rows = [AttnRows(pages[r.request_id][name], r.kv.labels[name].first_page, 0, self.spec.probe_rows, False)
                for r in reqs]
        try:
            found = self._probe(reqs, rows)
        except Exception as exc:
            log.exception("the language probe failed on %d request(s)", len(reqs))
            return [Failure(r, "internal error in the language probe", exc) for r in reqs]
        for r, lang in zip(reqs, found):
            r.prompt.insert(1, lang)
            r.report = {"language": self.spec.language_code(lang)}
        return []

    def _probe(self, reqs: list[Request], rows: list[AttnRows]) -> list[int]:
        """One decoder step on <|startoftranscript|> per request (its rows: `rows`, over its
        cross rows); the language token whose logit is highest, per request."""
        n = len(reqs)
        metas = self._metadata({self.self_label.name: rows})
        held = [r.kv.labels[self.cross_label.name] for r in reqs]
        cross = self.builder.cross([CrossRows(h.pages, h.rows, 1) for h in held],
                                   self.page_sizes[self.cross_label.name])
        ids = torch.full((n,), self.spec.decoder_start_token_id, dtype=torch.long, device=self.device)
        positions = torch.zeros(n, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            logits = self.model(ids, positions, self.self_caches, metas[self.self_label.name], self.cross_caches,
                                cross, torch.arange(n, device=self.device)).float()
        lang = self.language_ids.to(logits.device)
        return lang[logits[:, lang].argmax(-1)].tolist()

    def _encode(self, reqs: list[Request], rows: list[AttnRows]) -> None:
        meta = self.builder.build(rows, self.page_sizes[self.cross_label.name])
        feats = torch.cat([r.inputs["features"] for r in reqs]).to(self.dtype)
        with torch.inference_mode():
            enc = self.model.encode(feats)  # [B, n_frames, d]
            self.model.write_cross(enc.reshape(-1, enc.shape[-1]), self.cross_caches, meta)

    def call_model(self, ids, positions, metas: dict[str, AttnMetadata], sample_rows, plan: StepPlan) -> torch.Tensor:
        held = [e.request.kv.labels[self.cross_label.name] for e in plan.entries]
        cross = [CrossRows(h.pages, h.rows, e.rows) for h, e in zip(held, plan.entries)]
        cross_meta = self.builder.cross(cross, self.page_sizes[self.cross_label.name])
        return self.model(ids, positions, self.self_caches, metas[self.self_label.name], self.cross_caches, cross_meta,
                          sample_rows).float()

    def process_logits(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """The generation config's suppress lists, in place (-inf never samples)."""
        if self.suppress.numel():
            logits[:, self.suppress] = float("-inf")
        if self.begin_suppress.numel():
            first = [i for i, r in enumerate(requests) if not r.output]
            if first:
                logits[torch.tensor(first).unsqueeze(1), self.begin_suppress.unsqueeze(0)] = float("-inf")
        return logits
