"""The runner of Chatterbox's T3 (shared/specs/chatterbox.py): one engine step makes one
speech token of every request that samples in it, from two row sets a request.

The step loop, admission, footprints and stop checks are the decoder's; what is its own:
- the rows: every entry writes the same rows on label "cond" and on label "uncond" (the
  guidance row set); a row's input is an embedding the model makes from what the row is
  (the conditioning prefix, computed once a request from the voice and its
  `exaggeration`; a text id at its text position, zero in the guidance set; a speech token
  at its speech position), never a token table's row;
- one forward over both sets (one pool: one attention metadata over cond rows, then
  uncond rows);
- sampling as the package's `T3.inference` loop: `cond + cfg_weight * (cond - uncond)`,
  transformers' repetition penalty over the start of speech and the generated tokens,
  temperature, min-p, top-p (transformers' warpers' arithmetic), softmax and
  `torch.multinomial` with the request's seeded CPU generator (the package draws from the
  global CPU generator, which `torch.manual_seed(seed)` seeds the same way). Temperature
  0 is argmax (the package would divide by zero).

- a reference clip (tensor `context_audio`, 24 kHz): its conditionals are made once, with
  the request's prefix (modeling/speech/chatterbox_clip.py, on the CPU): T3's speaker
  embedding and prompt tokens in place of conds.pt's, S3Gen's prompt in place of its voice;

- sound: S3Gen (codecs/s3gen.py) in the codec thread (as the other speech runners'), once
  a request's last token is out: its flow matching attends over the whole utterance, so no
  sample is final before; earlier outputs carry no audio. Its noise continues the request's
  generator after T3's draws, as the package's continues its global one.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from services.gpu_worker.attention import AttnRows, cpu_backend
from services.gpu_worker.codec_thread import CodecThread, HeldSound, sound_bytes
from services.gpu_worker.codecs.s3gen import S3Gen
from services.gpu_worker.modeling.speech.chatterbox_clip import ChatterboxClip
from services.gpu_worker.request import Request
from services.gpu_worker.runners.base import ModelRunner
from services.gpu_worker.step_types import PlanEntry, StepPlan
from shared import trace
from shared.frames import Output
from shared.specs.base import ChatterboxRunnerSpec

log = logging.getLogger("mstar.chatterbox_runner")


class _Rows:
    """A step's rows as they are gathered, each by kind: the conditioning prefix's (a
    request's prefix tensor and the row in it), text rows, speech rows."""

    def __init__(self) -> None:
        self.t = 0
        self.cond: list[tuple[int, torch.Tensor, int]] = []
        self.text: list[tuple[int, int, int, bool]] = []  # (row, id, text position, guided)
        self.speech: list[tuple[int, int, int]] = []  # (row, token, speech position)
        self.positions: list[int] = []


class ChatterboxRunner(HeldSound, ModelRunner):
    SPEC = ChatterboxRunnerSpec

    def __init__(self, model, spec, kv, caches: dict[str, list[torch.Tensor]], planner=None) -> None:
        super().__init__(model, spec, kv, caches, planner)
        if spec.conds_path is None or not spec.conds_path.is_file():
            raise ValueError(f"the Chatterbox folder has no built-in voice ({spec.conds_path})")
        conds = torch.load(spec.conds_path, map_location="cpu", weights_only=True)["t3"]
        self.voice = (conds["speaker_emb"].float(), conds["cond_prompt_speech_tokens"].long())
        self.folder = spec.conds_path.parent
        self.codec = S3Gen(self.folder, self.device)
        self.thread = CodecThread()
        #: the clip encoders, loaded at the first request with a reference clip
        self.clips: ChatterboxClip | None = None

    def _backend(self) -> str:
        """The C kernels where they take the stack's attention, else torch (the step's rows
        are embeddings, not a decoder LM's token rows: no FlashInfer plan)."""
        if self.device.type != "cpu":
            return "torch"
        compute = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32)
        cfg = self.spec.config
        pick = cpu_backend(self.caches[self.spec.pool][0].dtype, compute, None, cfg.num_attention_heads,
                           cfg.num_key_value_heads)
        return "kernel" if pick == "kernel" else "torch"

    def make_request(self, tensors: dict[str, np.ndarray]) -> tuple[list[int], dict]:
        prompt, _ = super().make_request(tensors)
        guidance = tensors.get("guidance")
        if guidance is None or guidance.size != 2:
            raise ValueError("a Chatterbox request needs tensor 'guidance' [exaggeration, cfg_weight]")
        exaggeration, cfg_weight = (float(v) for v in guidance.reshape(-1))
        inputs: dict[str, object] = {"exaggeration": exaggeration, "cfg_weight": cfg_weight}
        clip = tensors.get("context_audio")
        if clip is not None:
            if clip.ndim != 1 or clip.size == 0:
                raise ValueError("a Chatterbox clip ('context_audio') is one non-empty row of 24 kHz samples")
            inputs["clip"] = clip.astype(np.float32, copy=False)
        return prompt, inputs

    # -- the forward -----------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> list[list[int]]:
        rows, step = [], _Rows()
        sampled: list[PlanEntry] = []
        last: dict[str, list[int]] = {name: [] for name in self.spec.labels}
        for name in self.spec.labels:
            for e in plan.entries:
                r, n = e.request, e.rows
                rows.append(AttnRows(e.pages[name], r.kv.labels[name].first_page, r.num_computed, n, e.decode))
                self._gather(r, n, name == "uncond", step)
                if r.num_computed + n == r.tokens_len:
                    last[name].append(step.t - 1)
                    if name == "cond":
                        sampled.append(e)
        meta = self._metadata({self.spec.labels[0]: rows})[self.spec.labels[0]]
        with torch.inference_mode():
            x = self._embed(step)
            pos = torch.tensor(step.positions, dtype=torch.long, device=self.device)
            hidden = self.model.backbone(x, pos, self.layer_caches, meta)
            if not sampled:
                return [[] for _ in plan.entries]
            cond = self.model.speech_logits(hidden[torch.tensor(last["cond"], device=self.device)])
            uncond = self.model.speech_logits(hidden[torch.tensor(last["uncond"], device=self.device)])
        made = {id(e): tok for e, tok in zip(sampled, self._draw(cond.cpu(), uncond.cpu(), sampled))}
        return [[made[id(e)]] if id(e) in made else [] for e in plan.entries]

    def _gather(self, r: Request, n: int, guided: bool, step: _Rows) -> None:
        """Rows [num_computed, num_computed + n) of `r` in one row set."""
        c = self.spec.cond_rows
        prompt_len = len(r.prompt)
        text_end = prompt_len - 2  # the start of speech twice closes the prompt
        for j in range(r.num_computed, r.num_computed + n):
            if j < c:
                step.cond.append((step.t, self._prefix(r), j))
            elif j < text_end:
                step.text.append((step.t, r.prompt[j], j - c, guided))
            elif j < prompt_len:
                step.speech.append((step.t, self.spec.bos, 0))
            else:  # a generated token's row, at speech position k + 1 for the k-th
                step.speech.append((step.t, r.output[j - prompt_len], j - prompt_len + 1))
            step.positions.append(j)
            step.t += 1

    def _prefix(self, r: Request) -> torch.Tensor:
        """The request's conditioning prefix rows (made once, kept on the request)."""
        if "prefix" not in r.inputs:
            spk, tokens = self.voice
            if "clip" in r.inputs:
                if self.clips is None:
                    self.clips = ChatterboxClip(self.folder)
                voice = self.clips.encode(r.inputs.pop("clip"))
                spk, tokens = voice.speaker_emb, voice.t3_tokens
                r.inputs["s3gen_voice"] = (voice.prompt_token, voice.prompt_feat, voice.xvector)
            with torch.inference_mode():
                r.inputs["prefix"] = self.model.cond_rows(spk, tokens, r.inputs["exaggeration"])
        return r.inputs["prefix"]

    def _embed(self, step: _Rows) -> torch.Tensor:
        w = self.model.speech_emb.weight
        x = torch.empty(step.t, w.shape[1], dtype=w.dtype, device=w.device)

        def long(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=w.device)

        for row, prefix, k in step.cond:
            x[row] = prefix[k]
        if step.text:
            at, ids, pos, guided = zip(*step.text)
            x[long(at)] = self.model.text_rows(long(ids), long(pos), torch.tensor(guided, device=w.device))
        if step.speech:
            at, toks, pos = zip(*step.speech)
            x[long(at)] = self.model.speech_rows(long(toks), long(pos))
        return x

    # -- sampling --------------------------------------------------------------------------

    def _draw(self, cond: torch.Tensor, uncond: torch.Tensor, entries: list[PlanEntry]) -> list[int]:
        out = []
        for i, e in enumerate(entries):
            r = e.request
            c, u = cond[i: i + 1], uncond[i: i + 1]
            logits = c + torch.as_tensor(r.inputs["cfg_weight"], dtype=c.dtype) * (c - u)
            logits = repetition_penalty(logits, [self.spec.bos, *r.output], r.sampling.repetition_penalty)
            sp = r.sampling
            if sp.temperature <= 0:
                out.append(int(logits[0].argmax()))
                continue
            if sp.temperature != 1.0:
                logits = logits / sp.temperature
            logits = min_p(logits, sp.min_p)
            if not (sp.top_p >= 1 and 0 < sp.min_p <= 1):
                # top_p at 1 drops only tokens of probability 0, and after min_p those are
                # its -inf ones already: skipped there (the defaults), a sort of the vocabulary less
                logits = top_p(logits, sp.top_p)
            probs = torch.softmax(logits, dim=-1)
            out.append(int(torch.multinomial(probs, num_samples=1, generator=r.generator)))
        return out

    # -- sound -----------------------------------------------------------------------------

    def on_emit(self, request: Request, reply_to: str, output: Output) -> bool:
        """Hold the output (in order); the last one's sound is the whole utterance's."""
        last = output.finish_reason is not None
        tokens = request.inputs.setdefault("tokens", [])
        tokens.extend(output.token_ids)
        self.thread.submit(reply_to, output, self._sound, list(tokens) if last else [], request.generator,
                           request.inputs.get("s3gen_voice"), last, output.request_id)
        return True

    def _sound(self, tokens: list[int], generator: torch.Generator, voice, last: bool, request_id: str) -> bytes:
        if not last:
            return b""
        trace.stamp(request_id, "gpu.codec_start")
        sound = sound_bytes([self.codec.decode(tokens, generator, voice)])
        trace.stamp(request_id, "gpu.codec_end")
        return sound


def repetition_penalty(scores: torch.Tensor, ids: list[int], penalty: float) -> torch.Tensor:
    """transformers' `RepetitionPenaltyLogitsProcessor` on one row [1, V]."""
    if penalty == 1.0:
        return scores
    idx = torch.tensor([ids], dtype=torch.long)
    score = torch.gather(scores, 1, idx)
    score = torch.where(score < 0, score * penalty, score / penalty)
    return scores.scatter(1, idx, score)


def min_p(scores: torch.Tensor, p: float) -> torch.Tensor:
    """transformers' `MinPLogitsWarper` (min_tokens_to_keep 1) on [1, V]."""
    if p <= 0:
        return scores
    probs = torch.softmax(scores, dim=-1)
    remove = probs < p * probs.amax(dim=-1, keepdim=True)
    if p <= 1:
        # the warper's sort only keeps its top token, which `remove` never holds at p <= 1
        # (its probability is the max): the same mask without an argsort over the
        # vocabulary (a third of a T3 step's time, profiled)
        return scores.masked_fill(remove, float("-inf"))
    order = torch.argsort(scores, descending=True, dim=-1)
    sorted_remove = torch.gather(remove, 1, order)
    sorted_remove[..., :1] = False
    return scores.masked_fill(sorted_remove.scatter(1, order, sorted_remove), float("-inf"))


def top_p(scores: torch.Tensor, p: float) -> torch.Tensor:
    """transformers' `TopPLogitsWarper` (min_tokens_to_keep 1) on [1, V]; the package runs
    it at top_p 1.0 too (it then drops only tokens of probability 0)."""
    sorted_logits, order = torch.sort(scores, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cum <= (1 - p)
    remove[..., -1:] = False
    return scores.masked_fill(remove.scatter(1, order, remove), float("-inf"))
