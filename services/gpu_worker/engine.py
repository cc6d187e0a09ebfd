"""Continuous batching for decoder LMs: requests join the running batch between steps,
and prefill chunks share a step with decode rows under a token budget.

Admission reserves a request's whole footprint (see kv_manager), so a running request
always finds its pages: nothing is ever preempted or recomputed. The decode loop never
runs past its cap; the cap is kept on the sequence, so no per-step state resets it.

Speculative decoding (prompt lookup, `speculative.py`) changes no footprint: a greedy
request's decode row may carry up to k draft rows, verified in the same forward (the
decode attention takes entries of several rows, each masked to its own prefix). Each accepted draft is one decode iteration (one committed
row, one token), and a step never drafts past what the request may still emit (its loop
cap, max_tokens, max_seq_len), so the rows it writes, rejected drafts included, stay
inside the rows its layout already declares.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from services.gpu_worker.attention import build_metadata
from services.gpu_worker.kv_manager import KVManager, LayoutViolation, RequestKV
from services.gpu_worker.sampler import make_generator, sample
from services.gpu_worker.speculative import NgramProposer, accept_greedy
from shared.errors import ErrorKind, new_error_id
from shared.frames import NewRequest, Output, RequestError, SamplingParams

log = logging.getLogger("mstar.engine")


@dataclass
class Sequence:
    request_id: str
    reply_to: str
    sampling: SamplingParams
    max_tokens: int
    caps: dict[str, int]
    prompt: list[int]
    kv: RequestKV
    generator: torch.Generator
    output: list[int] = field(default_factory=list)
    num_computed: int = 0  # rows of prompt + output already in KV
    iters: dict[str, int] = field(default_factory=dict)
    #: prompt lookup for a request that speculates (greedy, on a model without windows)
    proposer: NgramProposer | None = None
    drafts: list[int] = field(default_factory=list)  # this step's draft tokens

    @property
    def tokens_len(self) -> int:
        return len(self.prompt) + len(self.output)

    def token_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt)
        return (self.prompt[start:end] if end <= p else (self.prompt + self.output)[start:end])


@dataclass
class StepResult:
    outputs: list[tuple[str, Output]] = field(default_factory=list)
    errors: list[tuple[str, RequestError]] = field(default_factory=list)
    finished: list[tuple[str, int, str]] = field(default_factory=list)  # id, pages, status


class EngineBase:
    """What every step loop shares: the table of waiting and running requests, FIFO
    admission by footprint, and how a request ends (pages back, a finish or an error)."""

    kv: KVManager
    max_num_seqs: int
    #: speculative drafts verified and accepted over the worker's life (0 where the
    #: engine does not speculate)
    spec_draft_tokens = 0
    spec_accepted_tokens = 0
    waiting: deque
    running: list
    ids: dict

    def abort(self, request_id: str) -> tuple[str, int] | None:
        """Drop a request wherever it is; returns (reply_to, pages released) if it was here."""
        seq = self.ids.pop(request_id, None)
        if seq is None:
            return None
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        return seq.reply_to, self.kv.remove(request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.running) or bool(self.waiting and self._admissible())

    def _admissible(self) -> bool:
        return len(self.running) < self.max_num_seqs and self.kv.can_admit(self.waiting[0].kv)

    def step(self) -> StepResult:
        """Admit, schedule, run one forward, then commit and emit per request. A failed
        forward fails the requests in it; a layout violation fails only its request."""
        res = StepResult()
        self._admit(res)
        batch = self._schedule()
        if not batch:
            return res
        try:
            sampled = self._forward(batch)
        except Exception:
            error_id = new_error_id()
            log.exception("step failed (error_id=%s); failing its %d requests", error_id, len(batch))
            for seq, _ in batch:
                self._fail(seq, 500, "internal error in the model step", error_id, res)
            return res
        for (seq, n), toks in zip(batch, sampled):
            n, toks = self._kept(seq, n, toks)
            try:
                self._advance(seq, n)
            except LayoutViolation as exc:
                self._violation(seq, exc, res)
                continue
            if toks:
                self._emit(seq, toks, res)
        return res

    def _kept(self, seq, n: int, toks: list[int]) -> tuple[int, list[int]]:
        """Of a step's `n` rows and sampled tokens, the rows to commit and tokens to emit
        (all of them, but for a speculative verify step)."""
        return n, toks

    def _violation(self, seq, exc: LayoutViolation, res: StepResult) -> None:
        error_id = new_error_id()
        log.error("request %s: %s (error_id=%s)", seq.request_id, exc, error_id)
        self._fail(seq, 500, "internal error: the model's KV layout was violated", error_id, res)

    def _finish(self, seq, ran_to_caps: bool, status: str, res: StepResult) -> None:
        self.running.remove(seq)
        del self.ids[seq.request_id]
        res.finished.append((seq.request_id, self.kv.remove(seq.request_id, ran_to_caps), status))

    def _fail(self, seq, status: int, message: str, error_id: str, res: StepResult) -> None:
        if seq.request_id not in self.ids:
            return
        res.errors.append((seq.reply_to, RequestError(seq.request_id, ErrorKind.INTERNAL, message, error_id=error_id)))
        self._finish(seq, False, "error", res)

    def fail_all(self, kind: ErrorKind, message: str) -> StepResult:
        """End every request (used at shutdown); pages all return to the pools."""
        res = StepResult()
        for seq in list(self.running) + list(self.waiting):
            _, pages = self.abort(seq.request_id)
            res.finished.append((seq.request_id, pages, "error"))
            res.errors.append((seq.reply_to, RequestError(seq.request_id, kind, message)))
        return res


class Engine(EngineBase):
    def __init__(self, model, spec, kv: KVManager, caches: dict[str, list[torch.Tensor]], *,
                 eos_ids: list[int], max_num_seqs: int, max_batch_tokens: int, max_seq_len: int, planner=None,
                 speculative_k: int = 0, ngram_max: int = 3, ngram_min: int = 2) -> None:
        self.model = model
        #: FlashInferPlanner on CUDA, None for the torch path
        self.planner = planner
        self.spec = spec
        self.kv = kv
        self.loop = spec.decode_loop
        self.labels = spec.kv_labels
        self.windows = {lab.name: lab.window for lab in spec.kv_labels}
        self.page_sizes = {lab.name: kv.pools[lab.pool].config.page_size for lab in spec.kv_labels}
        # Layer i reads and writes label layer_labels[i], in its pool's i-th layer tensor.
        self.layer_labels: list[str] = spec.layer_labels
        taken: dict[str, int] = {}
        self.layer_caches = []
        for name in self.layer_labels:
            pool = spec.label(name).pool
            self.layer_caches.append(caches[pool][taken.get(pool, 0)])
            taken[pool] = taken.get(pool, 0) + 1
        self.eos = set(eos_ids)
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.max_seq_len = max_seq_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.ids: dict[str, Sequence] = {}
        # A windowed label releases pages behind its window as rows commit; draft rows
        # past the commit could straddle one page more than its footprint, so no drafts.
        windowed = any(w is not None for w in self.windows.values())
        self.speculative_k = 0 if windowed else speculative_k
        if speculative_k and windowed:
            log.warning("speculative decoding is off: the model has a sliding-window KV label")
        self.ngram = (ngram_max, ngram_min)

    # -- intake ----------------------------------------------------------------------

    def add(self, req: NewRequest, tensors: dict[str, np.ndarray]) -> None:
        """Ingest and queue a request; raises ValueError on a request this worker refuses."""
        if req.request_id in self.ids:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if req.max_tokens is None or req.max_tokens < 1:
            raise ValueError("NewRequest reached the worker without max_tokens")
        prompt = [int(t) for t in tensors["input_ids"].reshape(-1)]
        kv = self.kv.ingest_request(req)
        if not self.kv.fits_at_all(kv):
            raise ValueError("footprint exceeds the pool")
        seq = Sequence(req.request_id, req.reply_to, req.sampling, req.max_tokens, dict(req.loop_caps),
                       prompt, kv, make_generator(req.sampling.seed), iters={self.loop: 0})
        if self.speculative_k and req.sampling.greedy:
            seq.proposer = NgramProposer(*self.ngram)
        self.ids[seq.request_id] = seq
        self.waiting.append(seq)

    # -- one step --------------------------------------------------------------------

    def _admit(self, res: StepResult) -> None:
        # Oldest first and never skipping the head: a large request is not starved by
        # smaller ones arriving after it.
        while self.waiting and self._admissible():
            seq = self.waiting.popleft()
            seq.num_computed = self.kv.admit(seq.kv)  # rows shared from the prefix cache
            self.running.append(seq)

    def _schedule(self) -> list[tuple[Sequence, int]]:
        decodes = [s for s in self.running if s.num_computed >= len(s.prompt)]
        prefills = [s for s in self.running if s.num_computed < len(s.prompt)]
        budget = self.max_batch_tokens - len(decodes)
        batch = []
        for s in decodes:
            s.drafts = self._drafts(s, budget) if s.proposer is not None and budget > 0 else []
            budget -= len(s.drafts)
            batch.append((s, 1 + len(s.drafts)))
        for s in prefills:
            if budget <= 0:
                break
            n = min(len(s.prompt) - s.num_computed, budget)
            batch.append((s, n))
            budget -= n
        return batch

    def _kept(self, seq: Sequence, n: int, toks: list[int]) -> tuple[int, list[int]]:
        """A verify step keeps the accepted drafts and then the model's own token after
        them (a correction, or one past the last draft when all were accepted); the rows
        kept are the last token's and the accepted drafts'."""
        if not seq.drafts:
            return n, toks
        a = accept_greedy(seq.drafts, toks)
        self.spec_draft_tokens += len(seq.drafts)
        self.spec_accepted_tokens += a
        seq.drafts = []
        return a + 1, toks[: a + 1]

    def _drafts(self, seq: Sequence, budget: int) -> list[int]:
        """Prompt-lookup drafts for this step, never more than the request may still emit
        after the token this step samples anyway: its loop cap, max_tokens, max_seq_len."""
        k = min(self.speculative_k, budget, seq.caps.get(self.loop, 0) - seq.iters[self.loop] - 1,
                seq.max_tokens - len(seq.output) - 1, self.max_seq_len - seq.tokens_len - 1)
        return seq.proposer.propose(seq.prompt + seq.output, k) if k > 0 else []

    def _advance(self, seq: Sequence, n: int) -> None:
        """Commit the step's rows on every label (raises LayoutViolation under debug
        asserts); in the decode loop each row is one iteration (a verify step commits
        the last token and its accepted drafts)."""
        decode = seq.num_computed >= len(seq.prompt)
        for lab in self.labels:
            if decode:
                for _ in range(n):
                    self.kv.commit(seq.request_id, lab.name, 1, lab.grows_on)
            else:
                self.kv.commit(seq.request_id, lab.name, n, None)
        seq.num_computed += n
        if decode:
            seq.iters[self.loop] += n

    def _forward(self, batch: list[tuple[Sequence, int]]) -> list[list[int]]:
        """One forward over the batch; per entry, the tokens sampled for it: none for a
        prefill chunk that does not end its prompt, one per row for a verify step."""
        rows: dict[str, list] = {lab.name: [] for lab in self.labels}
        ids, positions, sample_rows, sample_seqs, sample_counts = [], [], [], [], []
        t = 0
        for seq, n in batch:
            before = len(sample_rows)
            # A verify step (a decode row with drafts) goes with the decode rows: every
            # row sees the rows before it, the drafts included (one batched attention).
            decode = seq.num_computed >= len(seq.prompt)
            for lab in self.labels:
                pages = self.kv.reserve_rows(seq.request_id, lab.name, n)
                first = seq.kv.labels[lab.name].first_page
                rows[lab.name].append((pages, first, seq.num_computed, n, decode))
            ids.extend(seq.token_slice(seq.num_computed, seq.num_computed + n - len(seq.drafts)))
            ids.extend(seq.drafts)
            if seq.drafts:
                sample_rows.extend(range(t, t + n))
            elif seq.num_computed + n == seq.tokens_len:
                sample_rows.append(t + n - 1)
            sample_counts.append(len(sample_rows) - before)
            sample_seqs.extend([seq] * sample_counts[-1])
            positions.extend(range(seq.num_computed, seq.num_computed + n))
            t += n
        metas = {name: build_metadata(r, self.page_sizes[name], self.windows[name], flashinfer=self.planner is not None) for name, r in rows.items()}
        device = self.layer_caches[0].device
        if device.type != "cpu":
            metas = {name: m.to(device) for name, m in metas.items()}
            if self.planner is not None:
                cache = self.layer_caches[0]
                for name, m in metas.items():
                    self.planner.plan(name, m, num_qo_heads=self.spec.config.num_attention_heads,
                                      num_kv_heads=cache.shape[3], head_dim=cache.shape[4], page_size=cache.shape[2],
                                      window=self.windows[name], dtype=cache.dtype,
                                      sm_scale=self.spec.config.attn_scale, softcap=self.spec.config.attn_softcap)
        # ids, positions and the sampled rows as one tensor (three views): from a Python
        # list each costs microseconds, a visible part of a one-row step
        flat = torch.from_numpy(np.array(ids + positions + sample_rows, dtype=np.int64)).to(device)
        n = len(ids)
        with torch.inference_mode():
            logits = self.model(flat[:n], flat[n : 2 * n], self.layer_caches, [metas[name] for name in self.layer_labels], flat[2 * n :])
            toks = sample(logits, [s.sampling for s in sample_seqs], [s.generator for s in sample_seqs])
        out, i = [], 0
        for count in sample_counts:
            out.append(toks[i : i + count])
            i += count
        return out

    def _emit(self, seq: Sequence, toks: list[int], res: StepResult) -> None:
        """Append the step's tokens (several after a verify step) and send them in one
        Output; the first stop condition met ends the request and drops what follows."""
        finish = None
        for n, tok in enumerate(toks, 1):
            seq.output.append(tok)
            if tok in self.eos and not seq.sampling.ignore_eos:
                finish = "stop"
            elif len(seq.output) >= seq.max_tokens or seq.tokens_len >= self.max_seq_len:
                finish = "length"
            if finish is not None:
                toks = toks[:n]
                break
        else:
            if seq.iters[self.loop] >= seq.caps.get(self.loop, 0):
                finish = "length"  # the loop's cap is reached: never run it further
        res.outputs.append((seq.reply_to, Output(seq.request_id, toks, finish, len(seq.prompt), len(seq.output))))
        if finish is not None:
            ran_to_caps = seq.iters[self.loop] >= seq.caps.get(self.loop, 0)
            self._finish(seq, ran_to_caps, "ok", res)
