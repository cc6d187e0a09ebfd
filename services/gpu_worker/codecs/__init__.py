"""Audio codecs that turn a speech model's codes into sound (TTS talkers' second half).

A codec holds no KV and runs beside the model's steps (DESIGN.md, "Speech out"): the worker
hands it each request's new frames and sends the audio chunks it emits.
"""

from services.gpu_worker.codecs.snac_codec import SnacCodec, SnacStream

__all__ = ["SnacCodec", "SnacStream"]
