"""One request as the step loop sees it, for every model.

What differs between models lives elsewhere: the runner turns a request's tensors into
its prompt (and, for an encoder-decoder model, keeps its audio features in `inputs` until
it has encoded them), and the model spec's labels and loops say what a step writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from services.gpu_worker.guided import Guide
from services.gpu_worker.kv_manager import RequestKV
from services.gpu_worker.speculative import NgramProposer
from services.gpu_worker.stop_check import StopCheck
from shared.frames import SamplingParams
from shared.layout import KVLabel


@dataclass
class Stage:
    """A request's later stage (an omni model's talker), set by the runner: the labels its
    steps write, the loop a step after its first iterates (its first step commits its
    prompt rows as a span), the rows its next step writes, and the runner's state.

    It may open while the earlier stage still decodes (DESIGN.md §3 "Stages": the talker
    starts at the thinker's first token, `ModelRunner.open_stage`): then both stages have
    an entry in a step, and the later one's step k waits until the earlier one has made
    k + `lead` outputs (what it reads of them), and a paced stage more (`pace`, `free`),
    unless the earlier one ended. Either may
    end first; the request ends when both have. `finish` is the earlier stage's
    finish_reason (sent on the request's last output)."""

    labels: tuple[KVLabel, ...]
    loop: str
    rows: int
    finish: str = ""
    #: the earlier stage ran every loop to its cap; once `done`, whether this stage's did
    at_caps: bool = False
    started: bool = False
    state: Any = None
    #: the earlier stage's outputs the later one's first step needs
    lead: int = 1
    #: steps this stage has run (its prompt's included)
    steps: int = 0
    #: the earlier stage has ended (its finish_reason is in `finish`)
    earlier_done: bool = True
    #: this stage has ended (it may before the earlier one does)
    done: bool = False
    #: while the earlier stage decodes, this stage's steps after its first `free` frames
    #: wait for `pace` earlier outputs each (1: one each, as its reading needs)
    pace: int = 1
    free: int = 0

    def ready(self, earlier_outputs: int) -> bool:
        """Whether this stage's next step has what it reads of the earlier stage, and (a
        paced stage, while the earlier one decodes) is due: past its first `free` steps
        after the prompt's, a step waits for `pace` more earlier outputs than the last, so
        the earlier stage's rows run alone in between and its text is not slowed to this
        stage's pace (an omni talker's frame with its code predictor costs several
        thinker steps, and it needs only one text row a frame)."""
        if self.done:
            return False
        if self.earlier_done:
            return True
        paced = max(0, self.steps - 1 - self.free) * (self.pace - 1)
        return earlier_outputs >= self.steps + self.lead + paced


@dataclass
class LoopState:
    """A request's in-step loop between worker steps (a denoising or flow-matching loop,
    DESIGN.md §3 "Denoising loops"): the runner sets it in the step that runs the request's
    prompt, then runs one iteration of it a step until `done` reaches `total` (never past
    the loop's cap) and the request's result is made. `state` is the runner's (latents, a
    multistep scheduler's history...), carried as is from one step to the next."""

    total: int
    state: Any = None
    done: int = 0

    @property
    def finished(self) -> bool:
        return self.done >= self.total


@dataclass
class Request:
    request_id: str
    reply_to: str
    sampling: SamplingParams
    max_tokens: int
    #: iterations each loop may run (the conductor's clamped caps)
    caps: dict[str, int]
    #: the token ids the model consumes before it generates (a decoder's prompt)
    prompt: list[int]
    kv: RequestKV
    generator: torch.Generator
    output: list[int] = field(default_factory=list)
    #: rows of prompt + output already in KV
    num_computed: int = 0
    #: prompt rows the prefix cache served at its first admission (its usage's cached tokens)
    cached_tokens: int = 0
    #: iterations each loop has run
    iters: dict[str, int] = field(default_factory=dict)
    #: False until the runner's admission work (an encoder pass) is done: not scheduled before
    ready: bool = True
    #: what the runner still needs of the request's input tensors (dropped once used)
    inputs: dict[str, Any] = field(default_factory=dict)
    #: prompt lookup, for a request that speculates (greedy, on a model without windows)
    proposer: NgramProposer | None = None
    #: the grammar state of a constrained request (structured outputs)
    guide: Guide | None = None
    #: its stop strings, where the worker checks them (`SamplingParams.stop`)
    stop_check: StopCheck | None = None
    #: `process_prompt`'s metadata (NewRequest.metadata), for the runner's hooks
    metadata: dict[str, Any] = field(default_factory=dict)
    #: what the run learned for the client (Whisper's detected language): sent once, on
    #: the request's first output
    report: dict[str, str] = field(default_factory=dict)
    #: what min_tokens masks: EOS (unless ignore_eos) and the request's stop_token_ids
    stop_ids: tuple[int, ...] = ()
    #: this step's logprobs, one per sampled row (when the request asked for them)
    step_logprobs: list[Any] = field(default_factory=list)
    #: prompt tokens' logprobs computed so far, sent with the first output (when asked)
    prompt_logprobs: list[Any] = field(default_factory=list)
    #: a pooling request's result (float32 bytes), set by the step that ran its prompt
    pooled: bytes | None = None
    #: prompt rows whose input is not a token's embedding (an image's rows from the vision
    #: tower): their prompt positions (ascending) and values, until the prefill computes them
    embeds: tuple[Any, torch.Tensor] | None = None
    #: a speech request's codec state (its `SnacStream`), dropped with the request
    codec: Any = None
    #: text ids its decode rows add, one a row in order (Qwen3-TTS' streamed text)
    text_feed: tuple[int, ...] = ()
    #: the stage a request runs after its first (None: its first, the only one for most models)
    stage: Stage | None = None
    #: its in-step loop once its prompt ran (None before, and for every model without one):
    #: the scheduler plans one iteration a step, writing no KV row (`PlanEntry.loop`)
    loop: LoopState | None = None

    @property
    def tokens_len(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def decoding(self) -> bool:
        """The prompt is all in KV: each step now feeds the last sampled token."""
        return self.num_computed >= len(self.prompt)

    def token_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt)
        return self.prompt[start:end] if end <= p else (self.prompt + self.output)[start:end]
