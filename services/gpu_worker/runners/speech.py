"""The runner hooks of a text-to-speech decoder (Orpheus): text in, SNAC frames out, sound
made beside the steps.

The step loop, admission, footprints and the prefix cache are the decoder's; what is its
own:
- `process_logits`: the k-th audio token of a request may only be a code of its frame
  slot's codebook (`OrpheusCodes.allowed(k)`), and `<end_of_speech>` only where a frame
  ends, so every frame is whole and valid (Orpheus' reference drops invalid codes after
  the fact, which shifts every later frame);
- `on_emit`: the tokens a step emitted become codes; each completed frame goes into the
  request's `SnacStream`, whose samples that no later frame can change ride on the same
  `Output` (`audio`, float32 little-endian at the codec's rate); the request's last output
  carries the rest (`finish`). The stream is the request's (`Request.codec`), so an aborted
  request drops it with everything else.

The codec runs in a thread of its own beside the steps (`CodecThread`,
codec_thread.py, as CSM's runner): a real SNAC decodes a frame in tens of milliseconds on
a CPU, which in the step's thread would delay every stream's next token by it. An output
waits for its sound (held, in emission order, and sent by a later step: `ready_outputs`),
so a request's chunks and its last output reach the api in order; when nothing else is to
do the engine waits for the oldest; a codec failure is that request's 500 with an error id.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.gpu_worker.codec_thread import CodecThread, HeldSound, sound_bytes
from services.gpu_worker.codecs.snac_codec import SnacCodec, SnacStream
from services.gpu_worker.request import Request
from services.gpu_worker.runners.base import ModelRunner
from shared.frames import Output
from shared.specs.base import SpeechRunnerSpec
from shared.specs.orpheus_codes import CODES_PER_FRAME

#: frames a chunk after the first waits for: each decode re-reads 5-6 frames of context, so
#: one frame a decode would cost ~7 frames of decoding per frame of sound, four ~2.5
CHUNK_FRAMES = 4


@dataclass
class Voice:
    """One request's codec state, touched by the codec thread only (after `on_emit` makes
    it): its stream, and the audio tokens of a frame not yet complete."""

    stream: SnacStream
    pending: list[int] = field(default_factory=list)


class SpeechRunner(HeldSound, ModelRunner):
    SPEC = SpeechRunnerSpec

    def __init__(self, model, spec, kv, caches: dict[str, list[torch.Tensor]], planner=None) -> None:
        super().__init__(model, spec, kv, caches, planner)
        self.codes = spec.codes
        self.codec = SnacCodec(spec.codec_path)
        if self.codec.codebook_size != self.codes.codebook_size:
            raise ValueError(f"the codec has {self.codec.codebook_size} codes a codebook; the model's tokens "
                             f"say {self.codes.codebook_size}")
        #: the codec thread, and the outputs waiting for their sound, in emission order
        self.thread = CodecThread()

    def process_logits(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Only the k-th audio token's codebook (and, at a frame's end, end_of_speech)."""
        keep = torch.zeros_like(logits, dtype=torch.bool)
        for i, r in enumerate(requests):
            k = len(r.output)
            lo, hi = self.codes.allowed(k)
            keep[i, lo:hi] = True
            if k and k % CODES_PER_FRAME == 0:
                keep[i, self.codes.end_of_speech] = True
        return logits.masked_fill(~keep, float("-inf"))

    def on_emit(self, request: Request, reply_to: str, output: Output) -> bool:
        """Hold the output; its sound is made in the codec thread (`_sound`)."""
        if request.codec is None:
            request.codec = Voice(self.codec.stream(CHUNK_FRAMES * self.codec.samples_per_frame))
        new = [t for t in output.token_ids if t != self.codes.end_of_speech]
        self.thread.submit(reply_to, output, self._sound, request.codec, new, output.finish_reason is not None)
        return True

    def _sound(self, voice: Voice, new: list[int], last: bool) -> bytes:
        """The samples the output's audio tokens `new` made final: the frames they complete,
        and on the request's last output whatever the stream still holds."""
        voice.pending += new
        done = len(voice.pending) // CODES_PER_FRAME * CODES_PER_FRAME
        chunks = []
        if done:
            start = voice.stream.frames_received * CODES_PER_FRAME  # the pending codes start a frame
            codes = self.codes.codes(voice.pending[:done], start)
            chunks.append(voice.stream.push(self.codes.frames(codes)))
            del voice.pending[:done]
        if last:
            chunks.append(voice.stream.finish())
        return sound_bytes(chunks)
