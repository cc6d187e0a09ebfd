"""The second part of a step: a plan in, sampled tokens out (inputs -> model -> sampler).

`ModelRunner` packs a plan into one forward: for every label the step writes, the pages of
each entry's rows (attention metadata, built once per label and shared by its layers),
then the token ids, positions and the rows that sample, as one tensor. What is special
about a kind of model is a few hooks of a subclass, not a second step loop:

- `make_request`: which input tensors a request brings and what its prompt is;
- `admission_rows` / `prepare`: rows written at admission, and the work that writes them
  (the encoder pass of an encoder-decoder model), into pages the scheduler reserved;
- `scratch_rows` / `probe`: a non-committing step at admission (Whisper's language probe);
- `call_model` and `process_logits`: extra inputs of the forward (the encoder's cross
  attention rows) and changes to the logits before sampling (Whisper's suppress lists).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from services.gpu_worker.attention import (
    BUILDERS,
    AttnMetadata,
    AttnRows,
    KernelBuilder,
    MetadataBuilder,
    cpu_backend,
)
from services.gpu_worker.kv_manager import KVManager
from services.gpu_worker.layers.prompt_rows import prompt_rows_from
from services.gpu_worker.modeling.decoder.cpu_stack import MAX_CHUNK_ROWS, CpuDecodeStack
from services.gpu_worker.request import Request
from services.gpu_worker.sampler import Row, prompt_logprobs, sample
from services.gpu_worker.step_types import Emitted, Failure, PlanEntry, StepPlan
from shared.frames import Output, RequestError
from shared.layout import KVLabel
from shared.specs.base import DecoderRunnerSpec

log = logging.getLogger("mstar.runner")


class ModelRunner:
    """A decoder LM: every label is written by every step, layer i reads label
    `spec.layer_labels[i]` in its pool's i-th layer tensor."""

    #: what this runner reads of its spec (checked at build: `refuse_runner_gaps`)
    SPEC: type = DecoderRunnerSpec  # a Protocol class (abstract, so not type[RunnerSpec])

    def __init__(self, model, spec, kv: KVManager, caches: dict[str, list[torch.Tensor]], planner=None) -> None:
        self.model = model
        self.spec: Any = spec
        self.kv = kv
        #: FlashInferPlanner on CUDA, None for the torch path
        self.planner = planner
        self.windows = {lab.name: lab.window for lab in spec.kv_labels}
        self.page_sizes = {lab.name: kv.pools[lab.pool].config.page_size for lab in spec.kv_labels}
        self.caches = caches
        self.device = next(iter(caches.values()))[0].device
        self.layer_caches = self._layer_caches()
        #: the one metadata builder of the attention backend every layer runs on
        self.builder: MetadataBuilder = BUILDERS[self._backend()]
        #: the model's C stack where steps of decode rows and short prompt chunks go to it
        #: whole (`_run_on_host`)
        self.host_stack = self._host_stack()

    def _host_stack(self) -> CpuDecodeStack | None:
        """The model's C stack, where this runner's steps can run in its one call from plain
        ints (`CpuDecodeStack.run_step`): where the model offers it (`DecoderLM.step_stack`),
        on the C kernels' attention, one position a row, and with this class's own
        `call_model` and `process_logits` (a subclass's extra inputs or logits changes are
        not the C call's)."""
        stack = getattr(self.model, "step_stack", None)
        cls = type(self)
        if (not isinstance(stack, CpuDecodeStack) or not isinstance(self.builder, KernelBuilder)
                or self.position_streams != 1 or cls.call_model is not ModelRunner.call_model
                or cls.process_logits is not ModelRunner.process_logits):
            return None
        return stack

    def _backend(self) -> str:
        """FlashInfer where a planner is given (CUDA); on the CPU the C kernels where they
        take this model's attention in every pool (`cpu_backend`), else torch. Attention sinks
        (gpt-oss) are not FlashInfer's here: torch's on CUDA."""
        if self.planner is not None and getattr(self.spec.config, "attn_sinks", False):
            return "torch"
        if self.planner is not None:
            return "flashinfer"
        if self.device.type != "cpu":
            return "torch"
        heads, softcap = self.attention_shape()
        compute = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32)
        picks = {cpu_backend(layers[0].dtype, compute, softcap, heads, layers[0].shape[3])
                 for layers in self.caches.values()}
        return "kernel" if picks == {"kernel"} else "torch"

    def attention_shape(self) -> tuple[int, float | None]:
        """(query heads, score soft-cap) of the model's attention, as the backend pick needs."""
        return self.spec.config.num_attention_heads, self.spec.config.attn_softcap

    def _layer_caches(self) -> list[torch.Tensor]:
        """Layer i's KV tensor: the next unused layer of its label's pool."""
        taken: dict[str, int] = {}
        out = []
        for name in self.spec.layer_labels:
            pool = self.spec.label(name).pool
            out.append(self.caches[pool][taken.get(pool, 0)])
            taken[pool] = taken.get(pool, 0) + 1
        return out

    # -- hooks ---------------------------------------------------------------------------

    @property
    def step_labels(self) -> tuple[KVLabel, ...]:
        """The labels a step writes rows of."""
        return self.spec.kv_labels

    #: requests need `prepare` (admission work) before they can be scheduled
    needs_prepare = False

    def check_layout(self, labels: set[str]) -> None:
        """ValueError for a request whose layouts this runner cannot run (the KV manager
        has already refused undeclared labels)."""

    def make_request(self, tensors: dict[str, np.ndarray]) -> tuple[list[int], dict]:
        """(the prompt ids, inputs the runner keeps for `prepare`); ValueError on bad tensors."""
        if "input_ids" not in tensors:
            raise ValueError("a decoder request needs tensor 'input_ids'")
        return [int(t) for t in tensors["input_ids"].reshape(-1)], {}

    def admission_rows(self, req: Request) -> dict[str, int]:
        """Rows `prepare` writes per label at admission (the scheduler reserves, then
        commits them); a decoder writes none: its requests are ready at once."""
        return {}

    def prepare(self, admitted: list[Request], pages: dict[str, dict[str, list[int]]]) -> list[Failure]:
        """Admission work for newly admitted requests, into the pages reserved for their
        `admission_rows` (request id -> label -> pages); returns those it could not do."""
        return []

    def scratch_rows(self, req: Request) -> dict[str, int]:
        """Scratch rows a prepared request's probe writes per label (none: no probe)."""
        return {}

    def probe(self, reqs: list[Request], pages: dict[str, dict[str, list[int]]]) -> list[Failure]:
        """A non-committing step over `scratch_rows` (the scheduler gives them back after)."""
        return []

    def step_scratch(self, entry: PlanEntry) -> dict[str, int]:
        """Scratch rows an entry's forward writes per label past its committed ones (CSM's
        depth decoder: one frame's codebooks), which the scheduler reserves before the
        step and gives back after it; none by default."""
        return {}

    def call_model(self, ids, positions, metas: dict[str, AttnMetadata], sample_rows, plan: StepPlan) -> torch.Tensor:
        return self.model(ids, positions, self.layer_caches, [metas[name] for name in self.spec.layer_labels],
                          sample_rows)

    def process_logits(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        return logits

    def copy_pages(self, copies: list[tuple[str, int, int]]) -> None:
        """Copy page `src` of `pool` onto page `dst`, in every layer of the pool (a hybrid's
        state snapshot: `KVManager.take_snapshots`)."""
        for pool, src, dst in copies:
            for layer in self.caches[pool]:
                layer[dst].copy_(layer[src])

    def on_emit(self, request: Request, reply_to: str, output: Output) -> bool:
        """What an output carries besides tokens (a speech model's sound), once the output
        processor made it; True when the runner holds the output to send it later itself
        (`ready_outputs`). Nothing by default: sent with the step."""
        return False

    def next_stage(self, request: Request, output: Output, at_caps: bool) -> bool:
        """The request's first stage ended with `output` (its finish_reason set): True when
        the request goes on to a later stage instead (`request.stage` set or, where
        `open_stage` set it, told the first ended; the output's finish_reason moved onto it
        and cleared, so the api keeps listening: "the text ended, the request continues");
        False by default, and where the later stage has ended already: the request ends."""
        return False

    def open_stage(self, request: Request) -> None:
        """The request's first stage emitted and goes on: a runner whose later stage may
        start while the first still decodes (DESIGN.md §3 "Stages") sets `request.stage`
        here, with `earlier_done` False; nothing by default."""

    def emit_stage(self, request: Request, tokens: list[int]) -> Emitted:
        """A later stage's step output (what it sampled: `tokens`), and whether it ends the
        request; only runners whose `next_stage` starts one are asked."""
        raise NotImplementedError

    #: an in-step loop's iterations send their progress (`Request.loop`: a video job's)
    reports_progress = False

    @property
    def holding(self) -> bool:
        """Outputs are held (their sound still being made)."""
        return False

    def ready_outputs(self, wait: bool) -> tuple[list[tuple[str, Output]], list[tuple[str, RequestError]]]:
        """Held outputs now complete, in the order they were emitted (`wait`: block for the
        oldest when nothing else is to do); and errors of those that failed."""
        return [], []

    #: positions per row: 1, or 3 for multimodal RoPE (temporal, height, width)
    position_streams = 1

    def positions(self, req: Request, start: int, n: int) -> Sequence[int]:
        """The RoPE positions of rows [start, start + n) of `req`, row-major
        (`position_streams` per row): the rows themselves for a text model. The model
        gets them as [T] (one stream) or [position_streams, T]."""
        return range(start, start + n)

    # -- the forward ---------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> list[list[int]]:
        """One forward over the plan; per entry, the tokens sampled for it: none for a
        prefill chunk that does not end its prompt, one per row for a verify step."""
        rows: dict[str, list] = {lab.name: [] for lab in self.step_labels}
        ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        sample_reqs: list[Request] = []
        counts: list[int] = []
        extras: list[list[int]] = []  # per sampled row: drafts generated before it (a verify step)
        prompt_rows: list[int] = []  # rows whose logits give prompt logprobs (never sampled)
        prompt_targets: list[tuple[Request, list[int]]] = []
        t = 0
        for e in plan.entries:
            r, n = e.request, e.rows
            before = len(sample_rows)
            for lab in self.step_labels:
                rows[lab.name].append(AttnRows(e.pages[lab.name], r.kv.labels[lab.name].first_page, r.num_computed, n,
                                               e.decode))
            ids.extend(r.token_slice(r.num_computed, r.num_computed + n - len(e.drafts)))
            ids.extend(e.drafts)
            if e.drafts:  # a verify step samples every row: each checks the draft after it
                sample_rows.extend(range(t, t + n))
                extras.extend(e.drafts[:j] for j in range(n))
            elif r.num_computed + n == r.tokens_len:
                sample_rows.append(t + n - 1)
                extras.append([])
            if r.sampling.prompt_logprobs is not None and not e.decode:
                _prompt_rows(r, t, n, prompt_rows, prompt_targets)
            counts.append(len(sample_rows) - before)
            sample_reqs.extend([r] * counts[-1])
            positions.extend(self.positions(r, r.num_computed, n))
            t += n
        if self.host_stack is not None and not prompt_rows:
            host = self._run_on_host_pieces(rows, ids, positions, sample_rows)
            if host is not None:
                return _split(_sample(host, sample_reqs, extras), counts)
        metas = self._metadata(rows)
        # ids, positions and the sampled rows as one tensor (three views): each tensor made
        # from a Python list has a fixed cost, a visible part of a one-row step
        flat = torch.from_numpy(np.array(ids + positions + sample_rows + prompt_rows, dtype=np.int64)).to(self.device)
        n, p = len(ids), len(ids) + len(positions)
        pos = flat[n:p] if self.position_streams == 1 else flat[n:p].view(n, self.position_streams).t()
        with torch.inference_mode(), prompt_rows_from(_first_prompt_row(plan)):
            logits = self.call_model(flat[:n], pos, metas, flat[p:], plan)
            if prompt_rows:  # the prompt rows come after the sampled ones
                _keep_prompt_logprobs(logits[len(sample_rows) :], prompt_targets)
                logits = logits[: len(sample_rows)]
            logits = self.process_logits(logits, sample_reqs)
            toks = _sample(logits, sample_reqs, extras)
        return _split(toks, counts)

    def _run_on_host_pieces(self, rows: dict[str, list[AttnRows]], ids: list[int], positions: list[int],
                            sample_rows: list[int]) -> np.ndarray | None:
        """`_run_on_host`, a step longer than the C stack takes (`MAX_CHUNK_ROWS`: a lone
        prompt's prefill) in pieces of at most that many rows, one call each, in row order:
        a piece's rows read the K/V (and a hybrid's state) the pieces before it wrote, as a
        prompt cut into chunks by the scheduler does, and each row is computed as it is in
        any chunk (layers/prompt_rows.py), so the tokens are the same. Why: the modules'
        path (the stack's fallback) took 12-17% more time for the same rows (an 896-row
        prefill of the bench's Q8_0 MoE: ~170 against ~142 ms of CPU, the hybrid's ~272
        against ~238), the issue 50/51 TTFT; a single call of every row would need
        attention scratch growing with rows x keys. None where the stack does not take it
        (the modules run the whole step); a later piece it refuses fails the step, since
        the pieces before it have moved a hybrid's state."""
        pieces = host_pieces(rows, len(ids), sample_rows)
        if pieces is None:
            return self._run_on_host(rows, ids, positions, sample_rows)
        out = []
        for i, (part, lo, hi, sampled) in enumerate(pieces):
            logits = self._run_on_host(part, ids[lo:hi], positions[lo:hi], sampled)
            if logits is None:
                if i == 0:
                    return None
                raise RuntimeError("the CPU stack refused a later piece of a long step")
            out.append(np.array(logits))  # (the stack's logits buffer is the next call's)
        return np.concatenate(out)

    def _run_on_host(self, rows: dict[str, list], ids: list[int], positions: list[int],
                        sample_rows: list[int]) -> np.ndarray | None:
        """The step's logits from the C stack's one call (decode rows, and short prompt
        chunks beside them), or None where it does not take the step (then the modules run
        it). No tensor is made on the way: with the caches cold from the step's weights each
        torch op costs tens of microseconds, and a step through the modules costs ~3 ms more
        on an 8-layer model (8 on SmolLM2's 30), prompt chunks or not."""
        stack, builder = self.host_stack, self.builder
        assert stack is not None and isinstance(builder, KernelBuilder)
        host = {name: builder.host(r, self.page_sizes[name], self.windows[name]) for name, r in rows.items()}
        return stack.run_step(ids, positions, sample_rows, [host[name] for name in self.spec.layer_labels],
                            self.layer_caches)

    def _metadata(self, rows: dict[str, list]) -> dict[str, AttnMetadata]:
        metas = {name: self.builder.build(r, self.page_sizes[name], self.windows[name]) for name, r in rows.items()}
        if self.device.type == "cpu":
            return metas
        metas = {name: m.to(self.device) for name, m in metas.items()}
        if self.planner is not None and self.builder.name == "flashinfer":
            cache = next(iter(self.caches.values()))[0]
            cfg = self.spec.config
            for name, m in metas.items():
                self.planner.plan(name, m, num_qo_heads=self.attention_shape()[0], num_kv_heads=cache.shape[3],
                                  head_dim=cache.shape[4], page_size=cache.shape[2], window=self.windows[name],
                                  dtype=cache.dtype, sm_scale=cfg.attn_scale, softcap=cfg.attn_softcap)
        return metas


def host_pieces(rows: dict[str, list[AttnRows]], t: int, sample_rows: list[int]
                ) -> list[tuple[dict[str, list[AttnRows]], int, int, list[int]]] | None:
    """A step of `t` rows cut into pieces of at most `MAX_CHUNK_ROWS` rows, as near equal
    as whole entries allow: per piece its rows per label (each entry's share of it, an
    entry cut between pieces as the scheduler cuts a prompt into chunks), its row range
    [lo, hi) and its sampled rows (piece-local). None for a step that fits one call, or one
    a piece would not take whole: a decode entry (its row and drafts) or a bidirectional
    block is never cut."""
    if t <= MAX_CHUNK_ROWS or not rows:
        return None
    entries = next(iter(rows.values()))
    if any(r.blocks for label in rows.values() for r in label):
        return None
    n_pieces = -(-t // MAX_CHUNK_ROWS)
    bounds = [t * k // n_pieces for k in range(n_pieces + 1)]
    starts, at = [], 0
    for r in entries:
        starts.append(at)
        at += r.new
    for r, s in zip(entries, starts):  # a decode entry stays whole
        if r.decode and any(s < b < s + r.new for b in bounds):
            return None
    pieces = []
    for lo, hi in itertools.pairwise(bounds):
        part: dict[str, list[AttnRows]] = {name: [] for name in rows}
        for i, s in enumerate(starts):
            a, b = max(lo, s), min(hi, s + entries[i].new)
            if a >= b:
                continue
            for name, label in rows.items():
                r = label[i]
                part[name].append(r._replace(cached=r.cached + a - s, new=b - a))
        pieces.append((part, lo, hi, [x - lo for x in sample_rows if lo <= x < hi]))
    return pieces


# -- logprobs and the logits processors' inputs ----------------------------------------


def _split(toks: list[int], counts: list[int]) -> list[list[int]]:
    """The step's sampled tokens per entry (`counts[i]` of them for entry i)."""
    out, i = [], 0
    for count in counts:
        out.append(toks[i : i + count])
        i += count
    return out


def _sample(logits: torch.Tensor | np.ndarray, reqs: list[Request], extras: list[list[int]]) -> list[int]:
    """Sample every row; a request that asked for logprobs gets this step's on
    `step_logprobs` (one per sampled row, for the output processor to send)."""
    rows = [Row(r.sampling, r.generator, r.prompt, [*r.output, *x] if x else r.output, r.stop_ids, r.guide)
            for r, x in zip(reqs, extras)]
    toks, lps = sample(logits, rows)
    for r in reqs:
        if r.sampling.logprobs is not None:
            r.step_logprobs = []
    for r, lp in zip(reqs, lps):
        if lp is not None:
            r.step_logprobs.append(lp)
    return toks


def _prompt_rows(r: Request, t: int, n: int, rows: list[int], targets: list[tuple[Request, list[int]]]) -> None:
    """A prefill chunk of a request that asked for prompt logprobs: the logits of each of
    its rows that predicts a prompt token (position q predicts token q + 1)."""
    start = r.num_computed
    end = min(start + n, len(r.prompt) - 1)
    if end > start:
        rows.extend(range(t, t + end - start))
        targets.append((r, r.prompt[start + 1 : end + 1]))


def _keep_prompt_logprobs(logits: torch.Tensor, targets: list[tuple[Request, list[int]]]) -> None:
    i = 0
    for r, tokens in targets:
        r.prompt_logprobs.extend(prompt_logprobs(logits[i : i + len(tokens)], tokens, r.sampling.prompt_logprobs or 0))
        i += len(tokens)


def _first_prompt_row(plan: StepPlan) -> int | None:
    """Where the step's prompt rows start (layers/prompt_rows.py): the scheduler plans the
    decode rows first, then the prompt chunks; None when there are none."""
    t, first = 0, None
    for e in plan.entries:
        if e.decode and first is not None:
            raise RuntimeError("a decode entry after a prompt chunk: prompt rows must come last in a step")
        if not e.decode and first is None:
            first = t
        t += e.rows
    return first
