"""What a step costs, learned as the engine runs: the scheduler sizes prefill chunks by it.

A step's wall time is modelled as linear in four features of its plan:

    seconds = c0 + c_row * rows + c_sample * sampled + c_key * keys / 1024

- `rows`: query rows through every layer (decode rows, drafts, prefill tokens): the GEMMs,
  norms and K/V writes of each layer, so its coefficient is per row x layers of this model;
- `sampled`: rows through the LM head and the sampler (one per decode row and draft, one
  for a chunk that ends its prompt);
- `keys`: query-key pairs attention reads over all layers' label (a row at position p
  reads p + 1 keys, so a chunk of n rows after o cached ones reads n * o + n (n + 1) / 2);
- `c0`: what a step costs whatever it holds (the Python around the forward, attention
  metadata, the weights streamed from memory when few rows run).

The fit is least squares with exponential forgetting (each past step's weight decays by
`DECAY` per step, so the model follows the machine as its load changes), pulled towards
the warm-up's fit (a ridge term worth `PRIOR_STEPS` steps at typical feature sizes) so that
a direction the recent steps do not vary in (16 decode rows, step after step) keeps what
warm-up measured, and coefficients are kept >= 0 (a negative cost would let the scheduler
grow a chunk for free). A step slower than `OUTLIER` x its prediction (the process lost
its core for a while) counts as `OUTLIER` x the prediction.
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

import numpy as np

log = logging.getLogger("mstar.step_costs")

#: per-step weight decay of past observations (half-life ~140 steps)
DECAY = 0.995
#: the warm-up prior weighs as much as this many steps of typical size
PRIOR_STEPS = 4.0
#: typical magnitude of each feature (1, rows, sampled, keys / 1024): the ridge's scale
TYPICAL = np.array([1.0, 64.0, 16.0, 64.0])
#: observations before the fit is trusted by the scheduler
MIN_STEPS = 4
#: a step slower than this multiple of its prediction is clipped to it
OUTLIER = 3.0
#: steps observed between two solves of the fit
RESOLVE = 16
KEY_UNIT = 1024.0


class StepShape(NamedTuple):
    """The features of one step's plan."""

    rows: int = 0
    sampled: int = 0
    keys: int = 0

    def __add__(self, other: StepShape) -> StepShape:  # type: ignore[override]  # element-wise, not tuple's concat
        return StepShape(self.rows + other.rows, self.sampled + other.sampled, self.keys + other.keys)


def chunk_shape(offset: int, n: int, sampled: int) -> StepShape:
    """`n` rows written after `offset` cached ones, `sampled` of them sampled."""
    return StepShape(n, sampled, n * offset + n * (n + 1) // 2)


class StepCosts:
    """The learned step-cost model (seconds).

    `observe` and `predict` run every step, so they add and multiply Python floats: the
    same IEEE operations numpy's outer product and decay would do element by element (the
    same bits), without numpy's per-call cost on 4-element arrays, which a decode step pays
    with its caches cold from the weights it streamed (observe took 66 us in a decode step
    of the default model, 13 on floats). The solve, every `RESOLVE` steps, takes them as
    arrays."""

    def __init__(self) -> None:
        self._a = [0.0] * 16  # sum of decayed x x^T, row-major
        self._b = [0.0] * 4  # sum of decayed x * seconds
        self.steps = 0
        self._coef = np.zeros(4)
        self._c: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0)  # _coef as floats, for predict
        self._unsolved = 0
        self.prior: np.ndarray | None = None

    @property
    def a(self) -> np.ndarray:
        return np.array(self._a).reshape(4, 4)

    @property
    def b(self) -> np.ndarray:
        return np.array(self._b)

    @property
    def ready(self) -> bool:
        return self.steps >= MIN_STEPS

    @property
    def coef(self) -> np.ndarray:
        """(c0, c_row, c_sample, c_key) in seconds, solved again once `RESOLVE` steps came in
        since the last solve (a step's observation is a few µs; a solve some tens)."""
        return self._coef if not self._unsolved else self._fresh()

    def _fresh(self) -> np.ndarray:
        if self._unsolved >= RESOLVE or self.steps <= RESOLVE:
            self._set(self._solve())
            self._unsolved = 0
        return self._coef

    def _set(self, coef: np.ndarray) -> None:
        self._coef = coef
        self._c = tuple(float(c) for c in coef)

    def predict(self, s: StepShape) -> float:
        if self._unsolved:
            self._fresh()
        c0, c_row, c_sample, c_key = self._c
        return c0 + c_row * s.rows + c_sample * s.sampled + c_key * (s.keys / KEY_UNIT)

    def observe(self, s: StepShape, seconds: float) -> None:
        x = (1.0, float(s.rows), float(s.sampled), s.keys / KEY_UNIT)
        if self.ready:
            seconds = min(seconds, OUTLIER * max(self.predict(s), 1e-4))
        a, b = self._a, self._b
        for i in range(4):
            xi = x[i]
            for j in range(4):
                a[4 * i + j] = a[4 * i + j] * DECAY + xi * x[j]
            b[i] = b[i] * DECAY + xi * seconds
        self.steps += 1
        self._unsolved += 1

    def anchor(self) -> None:
        """Keep the current fit as the prior later fits are pulled towards (after warm-up)."""
        self._set(self._solve())
        self._unsolved = 0
        self.prior = self._coef.copy()

    def _solve(self) -> np.ndarray:
        """Non-negative ridge least squares: drop a feature whose coefficient comes out
        negative and solve again without it (at most one pass per feature)."""
        reg = PRIOR_STEPS * TYPICAL**2 if self.prior is not None else 1e-6 * TYPICAL**2
        target = self.prior if self.prior is not None else np.zeros(4)
        a, b = self.a, self.b
        active = np.ones(4, dtype=bool)
        coef = np.zeros(4)
        for _ in range(4):
            idx = np.flatnonzero(active)
            m = a[np.ix_(idx, idx)] + np.diag(reg[idx])
            rhs = b[idx] + reg[idx] * target[idx]
            coef = np.zeros(4)
            coef[idx] = np.linalg.solve(m, rhs)
            if (coef >= 0).all():
                break
            active &= coef > 0
        return np.maximum(coef, 0.0)

    def chunk_within(self, seconds: float, offset: int, remaining: int, scored: bool = False) -> int:
        """The most rows (<= `remaining`) of one prompt, `offset` rows of it cached, that
        cost at most `seconds` more in a step; sampling their last row when they end it,
        and every row when `scored` (prompt logprobs put each through the LM head)."""
        if seconds <= 0 or remaining <= 0:
            return 0
        _, c_row, c_sample, c_key = self.coef
        # n rows cost c_row n + c_key (n offset + n (n + 1) / 2) / KEY_UNIT: solve for n
        qa = c_key / (2 * KEY_UNIT)
        qb = c_row + (c_sample if scored else 0.0) + c_key * (offset + 0.5) / KEY_UNIT
        # the positive root written 2 s / (qb + sqrt(qb^2 + 4 qa s)), which is s / qb when
        # qa = 0: the textbook (-qb + sqrt(...)) / 2 qa cancels catastrophically when the key
        # cost is tiny (a fit of steps that show none leaves ~1e-17 s, and 20 rows became 19)
        denom = qb + math.sqrt(qb * qb + 4 * qa * seconds)
        n = int(2 * seconds / denom + 1e-6) if denom > 0 else remaining
        if n >= remaining:
            return remaining if self._cost(offset, remaining, 1) <= seconds + 1e-9 else remaining - 1
        return max(n, 0)

    def _cost(self, offset: int, n: int, sampled: int) -> float:
        return self.predict(chunk_shape(offset, n, sampled)) - self.coef[0]

    def describe(self) -> str:
        c0, c_row, c_sample, c_key = self.coef
        return (f"{c0 * 1e3:.2f} ms + {c_row * 1e3:.3f} ms/row + {c_sample * 1e3:.3f} ms/sampled row "
                f"+ {c_key * 1e3:.4f} ms/1024 keys ({self.steps} steps)")


# -- warm-up -------------------------------------------------------------------------------

#: the prompt calibration prefills first (rows of one step)
CALIBRATION_ROWS = 256
#: a long prompt's rows (one step where the budget allows): its keys (n (n + 1) / 2, ~0.5 M
#: at 1,024) are what a long chat history's late chunks read, so the key coefficient is
#: measured there rather than extrapolated from short prompts 16 times over
CALIBRATION_LONG_ROWS = 1024


def calibration_groups(spec, max_batch_tokens: int, max_num_seqs: int) -> list[list[tuple[int, int]]]:
    """The prompts calibration runs, (rows, max_tokens) each, in groups run one after another."""
    n_big = max(1, min(CALIBRATION_ROWS, max_batch_tokens - 1, spec.max_seq_len - 8))
    n_long = max(1, min(CALIBRATION_LONG_ROWS, max_batch_tokens - 1, spec.max_seq_len - 8))
    k = max(1, min(8, max_num_seqs, max_batch_tokens // 16))
    groups = [[(n_big, 4)], [(min(16, n_big), 6)] * k, [(max(1, n_big // 4), 2)]]
    return [*groups, [(n_long, 2)]] if n_long > n_big else groups


def calibrate(engine, spec, pools: dict, max_batch_tokens: int, max_num_seqs: int) -> StepCosts:
    """Learn the step costs before the first request: steps of known, varied shapes (a long
    prefill, a batch of short prompts, decode rows one and several at a time, a shorter
    prefill), run twice through the real engine (the first pass pays for first-call
    allocations and is forgotten), then kept as the prior later fits lean on. Runs inside
    the worker's untracked warm-up: its pages all go back."""
    from services.gpu_worker.kv_manager import DoesNotFit
    from shared.frames import NewRequest, SamplingParams, pack_tensors
    from shared.specs.base import PromptRequest

    groups = calibration_groups(spec, max_batch_tokens, max_num_seqs)
    ids = spec.warmup_ids(199)  # ordinary ids: no media placeholder, which a bare prompt may not hold
    count = 0
    for _ in range(2):
        engine.scheduler.costs = StepCosts()
        for group in groups:
            for n, max_tokens in group:
                ppo = spec.process_prompt(PromptRequest([ids[j % len(ids)] for j in range(count, count + n)]))
                caps = spec.clamp_caps(spec.get_loop_caps(max_tokens, prompt_len=n))
                refs, _ = pack_tensors(ppo.new_input_tensors)
                greedy = SamplingParams(temperature=0.0, ignore_eos=True)
                req = NewRequest(f"calibrate-{count}", "", refs, greedy, "", n, max_tokens, ppo.kv_layout, caps,
                                 spec.kv_configs(ppo.kv_layout, caps, pools), metadata=ppo.metadata)
                count += 1
                try:
                    engine.add(req, ppo.new_input_tensors)
                except DoesNotFit:  # a small pool cannot hold this shape at all: learn from the rest
                    log.info("step-cost calibration skips a %d-row prompt the pool cannot hold", n)
            while engine.has_work:
                if engine.step().errors:
                    raise RuntimeError("a calibration request failed (see the error logged above)")
            for r in list(engine.running) + list(engine.waiting):  # what the pool could not admit
                engine.abort(r.request_id)
    costs = engine.scheduler.costs
    costs.anchor()
    return costs


# -- the calibration, kept across starts ---------------------------------------------------
#
# A calibration measures this machine running this model through this build of the
# kernels under these limits; the next start with all of them the same reads the fit back
# (`tuning_cache`: ~/.cache/mstar/tuning, MSTAR_TUNING_CACHE) instead of spending a second
# or more of steps on it. What is kept is the fit's sums (a, b, steps), from which `anchor`
# solves the very prior the calibration left, and its coefficients, to check it by.

#: bumped whenever what calibration runs changes
CALIBRATION_VERSION = 2


def costs_from_sums(a, b, steps: int) -> StepCosts:
    """The model a calibration with these sums left: the same prior, the same fit."""
    costs = StepCosts()
    costs._a = [float(v) for v in np.array(a, dtype=np.float64).reshape(16)]
    costs._b = [float(v) for v in np.array(b, dtype=np.float64).reshape(4)]
    costs.steps = int(steps)
    costs.anchor()
    return costs


def costs_record(costs: StepCosts) -> dict:
    return {"a": costs.a.tolist(), "b": costs.b.tolist(), "steps": costs.steps, "coef": costs.coef.tolist()}


def costs_from_record(record: dict) -> StepCosts | None:
    """The kept calibration, or None where it is not one calibration could have left
    (non-finite, too few steps, or its coefficients not what its sums solve to)."""
    try:
        costs = costs_from_sums(record["a"], record["b"], record["steps"])
    except np.linalg.LinAlgError:
        return None
    coef = np.array(record["coef"], dtype=np.float64)
    fine = (np.isfinite(costs.a).all() and np.isfinite(costs.b).all() and costs.steps >= MIN_STEPS
            and coef.shape == (4,) and np.allclose(costs.coef, coef, rtol=1e-9, atol=1e-15)
            and costs.predict(StepShape(1, 1, 1)) > 0)
    return costs if fine else None


def calibrate_cached(engine, spec, pools: dict, max_batch_tokens: int, max_num_seqs: int,
                     key_parts: dict | None) -> tuple[StepCosts, bool]:
    """`calibrate`'s model from the tuning cache when a calibration with the same
    `key_parts` was kept, else `calibrate` (workers starting together calibrate once) and
    kept; the engine's scheduler gets it either way. Returns (costs, whether cached).
    `key_parts` None: always calibrated."""
    from services.gpu_worker import tuning_cache

    def measure() -> StepCosts:
        return calibrate(engine, spec, pools, max_batch_tokens, max_num_seqs)

    parts = None if key_parts is None else [CALIBRATION_VERSION, key_parts]
    costs, hit = tuning_cache.cached("step-costs", parts, measure, costs_record, costs_from_record)
    engine.scheduler.costs = costs
    return costs, hit
