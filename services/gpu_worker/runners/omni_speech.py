"""Qwen3-Omni with speech out: the thinker's runner (`OmniRunner`) plus its talker stage
(runners/omni_talker.py) and Code2Wav (codecs/code2wav.py), in one request.

A request that asks for speech (its metadata's "voice", set by the spec from the chat
route's `audio.voice`) declares every label up front (shared/specs/qwen3_omni.py): the
thinker's, the talker's (its prompt rows, then a row a frame on `frame_loop`) and the code
predictor's scratch rows. It runs in two stages:
- the thinker decodes as any request; its text goes out as it comes. Its end (EOS, a stop
  token, max_tokens) does not end the request: `next_stage` moves the finish_reason onto
  the request's `Stage` and clears it on the output ("the text ended, the request goes
  on"), so the api keeps listening;
- the talker: its first step writes its prompt rows (built from the thinker's finished
  sequence by `talker_prompt`), each later step one frame row (the scheduler reserves and
  commits them on the stage's labels, `Stage.labels`, and counts `frame_loop`); every
  step but the first makes a frame (the code predictor on the "code" scratch rows,
  reserved by `step_scratch`, given back after the step). Talker steps of several requests
  run batched (`TalkerStep`), beside the thinker's steps of others in the same engine step.
- sound: each output's new frames go to the request's `Code2WavStream` in the codec thread
  (`CodecThread`), `CHUNK_FRAMES` at a time, the rest at the end; the output carries the
  samples (float32, 24 kHz) and no token ids (the codes are not text).
The request ends when the talker samples `codec_eos` or its frame loop reaches its cap; its
last output carries the thinker's finish_reason.

Image and audio prompts: the talker reads the thinker's hidden states at their rows (layer
`accept_hidden_layer`, `HiddenTap` around the prefill chunks holding them), kept on the
request; those rows are not keyed in the prefix cache for a speech request (the spec), so
they are always computed.

Not yet: the talker starting while the thinker still decodes (DESIGN.md "Stages" allows
it; here it starts after).
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
from services.gpu_worker.runners.omni_talker import TalkerPrompt, TalkerRun, TalkerSettings, TalkerStep, talker_prompt
from services.gpu_worker.step_types import Emitted, Failure, PlanEntry, StepPlan
from shared.frames import Output
from shared.specs.qwen3_omni import CODE_LABEL, FRAME_LOOP, TALKER_LABEL, TALKER_OPENING_ROWS, user_rows

log = logging.getLogger("mstar.omni_speech")

#: frames a sound chunk after the first gathers (each Code2Wav call has a fixed cost)
CHUNK_FRAMES = 4


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

    def next_stage(self, request: Request, output: Output, at_caps: bool) -> bool:
        """A request that asked for speech goes on to its talker when its text ends."""
        if request.metadata.get("voice") is None:
            return False
        s = self.settings
        rows = len(user_rows(request.prompt, s.im_start, s.user)) + TALKER_OPENING_ROWS
        assert output.finish_reason is not None
        request.stage = Stage(self.talker_labels, FRAME_LOOP, rows, output.finish_reason, at_caps)
        output.finish_reason = None
        return True

    def prepare(self, admitted: list[Request], pages: dict[str, dict[str, list[int]]]) -> list[Failure]:
        """A speech request keeps its images' grids (the talker's positions) and the rows
        whose hidden states the talker reads (its image and audio rows)."""
        for r in admitted:
            if r.metadata.get("voice") is None:
                continue
            grids = r.inputs.get("grids")
            r.metadata["talker_grids"] = [] if grids is None else [tuple(int(v) for v in g) for g in grids]
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
        return {CODE_LABEL: self.talker.groups} if stage is not None and stage.started else {}

    def execute(self, plan: StepPlan) -> list[list[int]]:
        """The thinker's entries through its step, the talker's through `TalkerStep`."""
        staged = [e for e in plan.entries if e.request.stage is not None]
        if not staged:
            return super().execute(plan)
        text = [e for e in plan.entries if e.request.stage is None]
        made = iter(super().execute(StepPlan(text, plan.shape)) if text else [])
        runs = [self._run(e.request) for e in staged]
        with torch.inference_mode():
            codes = iter(self.stage_step(runs, [e.pages[TALKER_LABEL] for e in staged],
                                         [e.pages.get(CODE_LABEL, []) for e in staged]))
        return [[next(codes)] if e.request.stage is not None else next(made) for e in plan.entries]

    def _run(self, r: Request) -> TalkerRun:
        """The request's talker state, its prompt built on its first step."""
        stage = r.stage
        assert stage is not None
        if stage.state is None:
            stage.state = TalkerRun(self._prompt(r))
        return stage.state

    def _prompt(self, r: Request) -> TalkerPrompt:
        assert r.stage is not None
        eos = (r.output[-1],) if r.stage.finish == "stop" and r.output else ()
        with torch.inference_mode():
            return talker_prompt(self.talker, self.settings, self.model.lm.model.embed_tokens, r.prompt + r.output,
                                 len(r.prompt), self.settings.speakers[str(r.metadata["voice"])], eos,
                                 r.metadata.get("talker_hidden"), r.metadata.get("talker_grids"))

    def emit_stage(self, request: Request, tokens: list[int]) -> Emitted:
        """A talker step's output: no token ids (its sound is added by `on_emit`); it ends
        the request at `codec_eos` or the frame loop's cap, with the text's finish_reason."""
        stage = request.stage
        assert stage is not None
        at_cap = request.iters.get(FRAME_LOOP, 0) >= request.caps.get(FRAME_LOOP, 0)
        ended = tokens[0] == self.settings.codec_eos or at_cap
        out = Output(request.request_id, [], stage.finish if ended else None, len(request.prompt),
                     len(request.output))
        return Emitted(out, request.reply_to, ended, ended and at_cap and stage.at_caps)

    # -- sound -------------------------------------------------------------------------

    def on_emit(self, request: Request, reply_to: str, output: Output) -> bool:
        """A talker output waits in the codec thread for its frames' samples."""
        if request.stage is None or output.token_ids or request.stage.state is None:
            return False
        run = request.stage.state
        frames, run.sent = run.frames[run.sent:], len(run.frames)
        if request.codec is None:
            request.codec = self.codec.stream(CHUNK_FRAMES)
        self.thread.submit(reply_to, output, _sound, request.codec, frames, output.finish_reason is not None)
        return True


def _sound(stream: Code2WavStream, frames: list[list[int]], last: bool) -> bytes:
    """The samples `frames` made final (in the codec thread); the rest on the last output."""
    chunks = []
    with torch.inference_mode():
        if frames:
            chunks.append(stream.push(np.asarray(frames, dtype=np.int64)))
        if last:
            chunks.append(stream.finish())
    return sound_bytes(chunks)
