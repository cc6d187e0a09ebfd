"""Qwen3-Omni with speech out: the thinker's runner (`OmniRunner`) plus its talker stage
(runners/omni_talker.py) and Code2Wav (codecs/code2wav.py), in one request.

A request that asks for speech (its metadata's "voice", set by the spec from the chat
route's `audio.voice`) declares every label up front (shared/specs/qwen3_omni.py): the
thinker's, the talker's (its prompt rows, then a row a frame on `frame_loop`) and the code
predictor's scratch rows. It runs in two stages:
- the thinker decodes as any request; its text goes out as it comes. At its first token
  `open_stage` opens the talker beside it (`Request.stage`): from then on a step may hold
  both the request's thinker row and its talker rows. Its end (EOS, a stop token,
  max_tokens) does not end the request while the talker runs: `next_stage` moves the
  finish_reason onto the `Stage` and clears it on the output ("the text ended, the
  request goes on"), so the api keeps listening, and sets `text_end` on it, so the api
  sends the text's held characters then, not at the sound's end;
- the talker: its first step writes its prompt rows (built by `talker_prompt` from the
  text so far), each later step one frame row and reads one more text row, so it waits
  (`Stage.ready`) until the thinker has made that token (`text_lead`, `known_text_rows`:
  rows past the text's end are `tts_eos` then `tts_pad`, known once the thinker ends).
  Past its first FREE_FRAMES frames, while the thinker writes, a frame also waits for
  TEXT_PACE more tokens than the last (`Stage.pace`): the thinker's rows run alone in
  between, so the text is not written at the talker's pace (issue 52; the sound is the
  same, each frame reading the same text row whenever it runs).
  The scheduler reserves and commits its rows on the stage's labels (`Stage.labels`,
  `PlanEntry.stage`) and counts `frame_loop`; every step but the first makes a frame
  (the code predictor on the "code" scratch rows, reserved by `step_scratch`, given back
  after the step). Talker steps of several requests run batched (`TalkerStep`), beside
  thinker steps in the same engine step;
- sound: each output's new frames go to the request's `Code2WavStream` in the codec thread
  (`CodecThread`), `CHUNK_FRAMES` at a time, the rest at the end; the output carries the
  samples (float32, 24 kHz) and no token ids (the codes are not text).
The request ends when both stages have: the talker at `codec_eos` or its frame loop's cap,
the thinker as any text; its last output carries the thinker's finish_reason. Once the
talker runs, text outputs wait in the codec thread behind the sound emitted before them,
so the api gets every output in emission order.

Image and audio prompts: the talker reads the thinker's hidden states at their rows (layer
`accept_hidden_layer`, `HiddenTap` around the prefill chunks holding them), kept on the
request; those rows are not keyed in the prefix cache for a speech request (the spec), so
they are always computed.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from services.gpu_worker.codec_thread import CodecThread, HeldSound, sound_bytes
from services.gpu_worker.codecs.code2wav import Code2WavCodec, Code2WavStream
from services.gpu_worker.modeling.speech.qwen3_omni_talker import PREFIX, Qwen3OmniTalker
from services.gpu_worker.modeling.vision.qwen3_omni import HiddenTap
from services.gpu_worker.request import Request, Stage
from services.gpu_worker.runners.omni import OmniRunner
from services.gpu_worker.runners.omni_talker import (
    TalkerPrompt,
    TalkerRun,
    TalkerSettings,
    TalkerStep,
    known_text_rows,
    talker_prompt,
    text_lead,
)
from services.gpu_worker.runners.omni_talker_sampling import TalkerSampling
from services.gpu_worker.step_types import Emitted, Failure, PlanEntry, StepPlan
from shared.frames import Output
from shared.specs.qwen3_omni import CODE_LABEL, FRAME_LOOP, TALKER_LABEL, TALKER_OPENING_ROWS, user_rows

log = logging.getLogger("mstar.omni_speech")

#: frames a sound chunk after the first gathers (each Code2Wav call has a fixed cost)
CHUNK_FRAMES = 4
#: while the thinker writes, the talker's frames after its first FREE_FRAMES (two sound
#: chunks: the first sound is not delayed) run one per TEXT_PACE text tokens, so the text
#: comes at about the thinker's own pace: on an H100 a frame with its code predictor costs
#: ~2 thinker steps, so 3 thinker steps and a frame still make a frame (80 ms of sound)
#: well within 80 ms; once the text ends, the talker runs every step
TEXT_PACE, FREE_FRAMES = 3, 2 * CHUNK_FRAMES


def load_talker(folder: Path, config: dict, device: torch.device, dtype: torch.dtype) -> Qwen3OmniTalker:
    """The talker and code predictor from the folder's safetensors (`talker.*` only)."""
    state: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if key.startswith(PREFIX):
                    state[key] = f.get_tensor(key)
    model = Qwen3OmniTalker(config)
    model.load_weights(state)
    model.reset_buffers()
    return model.to(device=device, dtype=dtype).eval()


class OmniSpeechRunner(HeldSound, OmniRunner):
    def __init__(self, model, spec, kv, caches: dict[str, list[torch.Tensor]], planner=None) -> None:
        super().__init__(model, spec, kv, caches, planner)
        folder = Path(spec.folder)
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        self.talker = load_talker(folder, spec.vlm_config, self.device, dtype)
        self.settings = TalkerSettings.from_config(spec.vlm_config)
        self.stage_step = TalkerStep(self.talker, self.settings, caches[TALKER_LABEL], caches[CODE_LABEL],
                                     kv.pools[spec.label(TALKER_LABEL).pool].config.page_size)
        self.talker_labels = (spec.label(TALKER_LABEL),)
        self.codec = Code2WavCodec(folder, spec.vlm_config["code2wav_config"], self.device)
        self.thread = CodecThread()

    @property
    def step_labels(self):
        return self.spec.thinker_labels  # the talker's: its stage's (`Stage.labels`)

    def check_layout(self, labels: set[str]) -> None:
        speech = {TALKER_LABEL, CODE_LABEL} & labels
        if speech and speech != {TALKER_LABEL, CODE_LABEL}:
            raise ValueError(f"a speech request needs layouts for both {TALKER_LABEL!r} and {CODE_LABEL!r}")

    # -- the stages --------------------------------------------------------------------

    def open_stage(self, request: Request) -> None:
        """A speech request's talker opens at the thinker's first token; its prompt reads
        the assistant turn's first tokens, and each later step one more (`Stage.lead`)."""
        if request.stage is None and request.output and request.metadata.get("voice") is not None:
            request.stage = Stage(self.talker_labels, FRAME_LOOP, self._talker_rows(request), earlier_done=False,
                                  lead=text_lead(request.prompt, self.settings), pace=TEXT_PACE,
                                  free=FREE_FRAMES)

    def next_stage(self, request: Request, output: Output, at_caps: bool) -> bool:
        """A speech request goes on to its talker when its text ends (the talker opened
        already, or opens now), unless the talker ended first."""
        if request.metadata.get("voice") is None:
            return False
        assert output.finish_reason is not None
        stage = request.stage
        if stage is None:
            request.stage = Stage(self.talker_labels, FRAME_LOOP, self._talker_rows(request), output.finish_reason,
                                  at_caps)
        elif stage.done:
            return False
        else:
            stage.finish, stage.at_caps, stage.earlier_done = output.finish_reason, at_caps, True
        output.finish_reason, output.text_end = None, True
        return True

    def _talker_rows(self, request: Request) -> int:
        s = self.settings
        return len(user_rows(request.prompt, s.im_start, s.user)) + TALKER_OPENING_ROWS

    def prepare(self, admitted: list[Request], pages: dict[str, dict[str, list[int]]]) -> list[Failure]:
        """A speech request keeps its images' grids (the talker's positions) and the rows
        whose hidden states the talker reads (its image and audio rows)."""
        for r in admitted:
            if r.metadata.get("voice") is None:
                continue
            grids = r.inputs.get("grids")
            r.metadata["talker_grids"] = [] if grids is None else [tuple(int(v) for v in g) for g in grids]
            if r.inputs.get("video_seconds") is not None:
                r.metadata["talker_seconds"] = r.inputs["video_seconds"]
            mm = np.flatnonzero(np.isin(np.asarray(r.prompt), self.settings.multimodal))
            if len(mm):
                r.metadata["talker_rows"] = mm
        return super().prepare(admitted, pages)

    def call_model(self, ids, positions, metas, sample_rows, plan: StepPlan) -> torch.Tensor:
        """The thinker's forward; where a prompt chunk of a speech request holds image or
        audio rows, their hidden states at `accept_hidden_layer` are kept on the request
        (`HiddenTap`), what its talker prompt reads."""
        taps, rows, t, n = [], [], 0, 0
        for e in plan.entries:
            r = e.request
            where = r.metadata.get("talker_rows")
            if where is not None and not e.decode:
                lo, hi = np.searchsorted(where, [r.num_computed, r.num_computed + e.rows])
                if hi > lo:
                    taps.append((r, where[lo:hi], n))
                    rows.append(where[lo:hi] - r.num_computed + t)
                    n += hi - lo
            t += e.rows
        if not taps:
            return super().call_model(ids, positions, metas, sample_rows, plan)
        lm = self.model.lm
        lm.tap = HiddenTap(self.settings.accept_hidden_layer, torch.from_numpy(np.concatenate(rows)).to(self.device))
        try:
            out = super().call_model(ids, positions, metas, sample_rows, plan)
            hidden = lm.tap.out
        finally:
            lm.tap = None
        assert hidden is not None
        for r, at, start in taps:
            kept = r.metadata.get("talker_hidden")
            if kept is None:
                kept = r.metadata["talker_hidden"] = hidden.new_zeros(len(r.prompt), hidden.shape[1])
            kept[torch.from_numpy(at).to(self.device)] = hidden[start: start + len(at)]
        return out

    def step_scratch(self, entry: PlanEntry) -> dict[str, int]:
        """A talker step after its first makes a frame: the code predictor's rows."""
        stage = entry.request.stage
        return {CODE_LABEL: self.talker.groups} if entry.stage and stage is not None and stage.started else {}

    def execute(self, plan: StepPlan) -> list[list[int]]:
        """The thinker's entries through its step, the talker's through `TalkerStep`."""
        staged = [e for e in plan.entries if e.stage]
        if not staged:
            return super().execute(plan)
        text = [e for e in plan.entries if not e.stage]
        made = iter(super().execute(StepPlan(text, plan.shape)) if text else [])
        with torch.inference_mode():
            runs = [self._run(e.request) for e in staged]
            codes = iter(self.stage_step(runs, [e.pages[TALKER_LABEL] for e in staged],
                                         [e.pages.get(CODE_LABEL, []) for e in staged]))
        return [[next(codes)] if e.stage else next(made) for e in plan.entries]

    def _run(self, r: Request) -> TalkerRun:
        """The request's talker state, its prompt built on its first step; the text rows of
        what the thinker generated since its last step added."""
        stage = r.stage
        assert stage is not None
        if stage.state is None:
            stage.state = TalkerRun(self._prompt(r), closed=stage.earlier_done,
                                    sampling=TalkerSampling.of(r.metadata, r.sampling.seed))
            return stage.state
        run = stage.state
        if not run.closed:
            eos = _ended_by(r)
            known = known_text_rows(len(r.prompt), r.output, run.p.text_from, stage.earlier_done, eos)
            have = run.p.trailing.shape[0]
            assert known >= have, (known, have)
            new = (r.prompt + r.output)[run.p.text_from + have: run.p.text_from + known]
            rows = None
            if new:
                embed = self.model.lm.model.embed_tokens
                rows = self.talker.text_projection(embed(torch.tensor(new, device=self.device)))
            run.extend(rows, stage.earlier_done)
        return run

    def _prompt(self, r: Request) -> TalkerPrompt:
        stage = r.stage
        assert stage is not None
        eos = _ended_by(r)
        return talker_prompt(self.talker, self.settings, self.model.lm.model.embed_tokens, r.prompt + r.output,
                             len(r.prompt), self.settings.speakers[str(r.metadata["voice"])], eos,
                             r.metadata.get("talker_hidden"), r.metadata.get("talker_grids"), stage.earlier_done,
                             r.metadata.get("talker_seconds"))

    def emit_stage(self, request: Request, tokens: list[int]) -> Emitted:
        """A talker step's output: no token ids (its sound is added by `on_emit`). At
        `codec_eos` or the frame loop's cap the talker ends: the request with it, with the
        text's finish_reason, if the text has ended; else the request goes on with its text."""
        stage = request.stage
        assert stage is not None
        at_cap = request.iters.get(FRAME_LOOP, 0) >= request.caps.get(FRAME_LOOP, 0)
        ended = tokens[0] == self.settings.codec_eos or at_cap
        if ended and not stage.earlier_done:
            stage.done, stage.at_caps = True, at_cap
            out = Output(request.request_id, [], None, len(request.prompt), len(request.output))
            return Emitted(out, request.reply_to, False, False)
        out = Output(request.request_id, [], stage.finish if ended else None, len(request.prompt),
                     len(request.output))
        return Emitted(out, request.reply_to, ended, ended and at_cap and stage.at_caps)

    # -- sound -------------------------------------------------------------------------

    def on_emit(self, request: Request, reply_to: str, output: Output) -> bool:
        """Once the talker runs, every output waits in the codec thread: a talker output for
        its frames' samples, a thinker output (text) behind the sound emitted before it, so
        the api gets them in emission order."""
        stage = request.stage
        if stage is None or stage.state is None:
            return False
        if output.token_ids:
            self.thread.submit(reply_to, output, _no_sound)
            return True
        run = stage.state
        frames, run.sent = run.frames[run.sent:], len(run.frames)
        if request.codec is None:
            request.codec = self.codec.stream(CHUNK_FRAMES)
        self.thread.submit(reply_to, output, _sound, request.codec, frames,
                           output.finish_reason is not None or stage.done)
        return True


def _ended_by(r: Request) -> tuple[int, ...]:
    """The thinker's last token where it is an end marker the talker does not speak (EOS
    or a stop token: its text row is `tts_eos`), else none: a text that ended at its length,
    or at a stop string (`Request.stop_check`), is spoken to its last token, as transformers'
    talker reads the thinker's sequence that `StopStringCriteria` ended."""
    stage = r.stage
    assert stage is not None
    by_string = r.stop_check is not None and r.stop_check.matched is not None
    return (r.output[-1],) if stage.finish == "stop" and r.output and not by_string else ()


def _no_sound() -> bytes:
    """A text output's sound (none): it only keeps its place among the held outputs."""
    return b""


def _sound(stream: Code2WavStream, frames: list[list[int]], last: bool) -> bytes:
    """The samples `frames` made final (in the codec thread); the rest on the last output."""
    chunks = []
    with torch.inference_mode():
        if frames:
            chunks.append(stream.push(np.asarray(frames, dtype=np.int64)))
        if last:
            chunks.append(stream.finish())
    return sound_bytes(chunks)
