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

The codec runs in the step's thread, after the forward: it is a few small convolutions a
frame (measured in docs/benchmarks.md), and running it elsewhere would need its own copy
of each request's stream state; a thread of its own is the next step if it shows in the
step time.
"""

from __future__ import annotations

import numpy as np
import torch

from services.gpu_worker.codecs.snac_codec import SnacCodec, SnacStream
from services.gpu_worker.request import Request
from services.gpu_worker.runner import ModelRunner
from shared.frames import Output
from shared.specs.base import SpeechRunnerSpec
from shared.specs.orpheus_codes import CODES_PER_FRAME


class SpeechRunner(ModelRunner):
    SPEC = SpeechRunnerSpec

    def __init__(self, model, spec, kv, caches: dict[str, list[torch.Tensor]], planner=None) -> None:
        super().__init__(model, spec, kv, caches, planner)
        self.codes = spec.codes
        self.codec = SnacCodec(spec.codec_path)
        if self.codec.codebook_size != self.codes.codebook_size:
            raise ValueError(f"the codec has {self.codec.codebook_size} codes a codebook; the model's tokens "
                             f"say {self.codes.codebook_size}")

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

    def on_emit(self, request: Request, output: Output) -> None:
        """The output's audio: the samples its completed frames made final (all that is left
        when the request ends)."""
        stream: SnacStream | None = request.codec
        if stream is None:
            stream = request.codec = self.codec.stream()
        audio_tokens = [t for t in request.output if t != self.codes.end_of_speech]
        done = len(audio_tokens) // CODES_PER_FRAME
        chunks = []
        if done > stream.frames_received:
            start = stream.frames_received * CODES_PER_FRAME
            codes = self.codes.codes(audio_tokens[start : done * CODES_PER_FRAME], start)
            chunks.append(stream.push(self.codes.frames(codes)))
        if output.finish_reason is not None:
            chunks.append(stream.finish())
        if chunks:
            output.audio = np.concatenate(chunks).astype("<f4").tobytes()
