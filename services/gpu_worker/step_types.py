"""The values the parts of a step hand each other (vLLM v1's SchedulerOutput /
ModelRunnerOutput / EngineCoreOutputs, in this engine's terms).

The scheduler, the runner and the output processor are peers under the engine: none
imports another, only this module. The scheduler alone changes KV state: it reserves the
pages a plan writes, commits what the outputs kept, and removes the requests that ended;
the runner and the output processor only read what it recorded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from services.gpu_worker.request import Request
from services.gpu_worker.step_costs import StepShape
from shared.errors import ErrorKind
from shared.frames import Output, RequestError

#: what a client is told when its request broke its own layout
LAYOUT_VIOLATED = "internal error: the model's KV layout was violated"
#: ... and when it needed a page past its footprint with none left that nobody reserved
OVERRUN = "internal error: the model's KV layout under-stated what this request writes"


@dataclass
class PlanEntry:
    """One request's part of a step: `rows` rows written (the last of them sampled when
    the request's prompt ends there), of which the trailing `drafts` are speculative."""

    request: Request
    rows: int
    decode: bool
    drafts: list[int] = field(default_factory=list)
    #: per label the step writes, the request's live pages once the scheduler reserved its rows
    pages: dict[str, list[int]] = field(default_factory=dict)
    #: labels whose scratch rows the step wrote (given back after it)
    scratch: list[str] = field(default_factory=list)
    #: the step of the request's later stage (`Request.stage`), not of its first
    stage: bool = False
    #: one iteration of the request's in-step loop (`Request.loop`): no row written (`rows` 0)
    loop: bool = False


@dataclass
class StepPlan:
    entries: list[PlanEntry] = field(default_factory=list)
    #: rows, sampled rows and attention keys of the plan: what the step-cost model sees
    shape: StepShape = field(default_factory=StepShape)


class Failure(NamedTuple):
    """A request a part of the step could not serve: the client-safe message, and the
    cause (logged under the error id)."""

    request: Request
    message: str
    cause: BaseException | None = None


class Kept(NamedTuple):
    """What a plan entry keeps of its sampled tokens: the rows to commit (a verify step
    keeps its last token's row and the accepted drafts'), and the tokens to emit."""

    rows: int
    tokens: list[int]


class Emitted(NamedTuple):
    """An entry's tokens as sent, and whether they ended the request (`ran_to_caps`: every
    loop reached its cap, for the KV manager's under-use check)."""

    output: Output
    reply_to: str
    ended: bool
    ran_to_caps: bool


class Finished(NamedTuple):
    request_id: str
    pages: int  # pages its end released
    status: str  # "ok" | "error" | "abort"


@dataclass
class StepResult:
    """What one step tells the world, by destination: token outputs and errors for the
    api (each request's `reply_to`), finished requests for the conductor."""

    outputs: list[tuple[str, Output]] = field(default_factory=list)
    errors: list[tuple[str, RequestError]] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)


def error_frame(request_id: str, kind: ErrorKind, message: str, error_id: str | None = None) -> RequestError:
    """The frame for a request that failed in this worker."""
    return RequestError(request_id=request_id, kind=kind, message=message, error_id=error_id)
