"""Qwen3-Omni's text is not paced by its talker (issue 52): the talker stage's pacing
(`Stage.ready` with `pace`/`free`) and the api's flush of the text at its end
(`Output.text_end`), not at the end of the sound spoken after it."""

from __future__ import annotations

import asyncio

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from services.api.backend import RequestHandle
from services.api.events import DeltaEvent
from services.api.generation import Generation
from services.api.metrics import ApiMetrics
from services.gpu_worker.request import Stage
from shared.detokenize import IncrementalDetokenizer
from shared.frames import Output


def _due_steps(stage: Stage, outputs: int) -> list[int]:
    """At which earlier-stage output counts (1..outputs) the stage runs a step, one at most
    an output (a step's thinker row makes one), as the scheduler would plan it."""
    ran = []
    for n in range(1, outputs + 1):
        if stage.ready(n):
            stage.started, stage.steps = True, stage.steps + 1
            ran.append(n)
    return ran


def test_a_paced_stage_runs_one_step_per_pace_outputs_past_its_free_ones() -> None:
    plain = _due_steps(Stage((), "frame_loop", 3, earlier_done=False, lead=2), 12)
    assert plain == list(range(2, 13))  # one a step from its lead on
    paced = _due_steps(Stage((), "frame_loop", 3, earlier_done=False, lead=2, pace=3, free=2), 14)
    # the prompt at 2, free frames at 3 and 4, frame 2 at 5, then one each 3 outputs
    assert paced == [2, 3, 4, 5, 8, 11, 14]
    stage = Stage((), "frame_loop", 3, earlier_done=False, lead=2, pace=3, free=2)
    _due_steps(stage, 9)
    assert not stage.ready(9)
    stage.earlier_done = True  # the text ended: every step
    assert stage.ready(9)
    stage.done = True
    assert not stage.ready(9)


class _Backend:
    def abort(self, request_id: str, reason: str = "abort") -> None:
        pass


def test_the_text_end_flushes_held_characters_before_later_sound() -> None:
    """A text ending in half a character (a byte-level token of its first byte): its
    replacement character is sent at `text_end`, before the sound that follows."""
    tok = Tokenizer(models.BPE(vocab={"a": 0, "\u00c3": 1}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    handle = RequestHandle("r", _Backend())  # type: ignore[arg-type]
    gen = Generation(handle, IncrementalDetokenizer(tok), ApiMetrics("served"), client_id="r", started=0.0)
    for out in (Output("r", [0, 1], None, 5, text_end=True), Output("r", [], None, 5, audio=b"\0" * 8),
                Output("r", [], "length", 5, audio=b"\0" * 4)):
        handle.put(out)

    async def run() -> list:
        return [e async for e in gen.events()]

    events = asyncio.run(run())
    gen.close()
    deltas = [(e.text, len(e.audio or b"")) for e in events if type(e) is DeltaEvent]
    assert deltas == [("", 0), ("a\ufffd", 0), ("", 8), ("", 4)]  # (the ids' delta held "a" with the half)
