"""The runner of Qwen3-Omni's thinker: `MropeVisionRunner` (images at admission, three
positions a row) plus audio inputs. A video's rows are an image's with t temporal patches:
its tokens are vision rows beside the image tokens, its patches and grid in "pixel_values"
and "image_grid_thw" in prompt order (`shared.specs.qwen3_omni`), one tower pass (with
deepstack) over both, as transformers' thinker encodes `pixel_values_videos`.

At admission (`prepare`) a request's clips go through the audio encoder together (one
request at a time: the encoder's attention windows follow the longest conv window of the
clips encoded together, so encoding one prompt's clips alone is what transformers computes
for that prompt), beside its images through the vision tower. Both kinds of rows are kept
on the request as one sorted set (`Request.embeds`): the image rows carry their deepstack
rows beside them ([hidden * (1 + D)]); audio rows, where the request also has images, are
padded with zeros to that width (the model adds deepstack rows to image tokens' rows only).
The prefill that computes a row takes it in place of the placeholder's embedding, as for
images alone (`VisionRunner._step_embeds`).

Rows, KV, footprints and the prefix cache are the decoder's: an audio clip's rows are one
keyed `rows` span (`shared.specs.qwen3_omni`), and a clip whose rows the prefix cache holds
is not encoded again.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from services.gpu_worker.request import Request
from services.gpu_worker.runners.mrope import MropeVisionRunner
from services.gpu_worker.runners.vision import all_cores
from services.gpu_worker.step_types import Failure
from shared.specs.qwen3_omni import audio_rows

log = logging.getLogger("mstar.omni_runner")


class OmniRunner(MropeVisionRunner):
    def __init__(self, model, spec, kv, caches: dict[str, list[torch.Tensor]], planner=None) -> None:
        super().__init__(model, spec, kv, caches, planner)
        self.audio_token_id = int(spec.audio_token_id)
        self.n_window = int(spec.n_window)
        self.vision_ids = np.asarray([self.image_token_id, spec.video_token_id], dtype=np.int64)

    def make_request(self, tensors: dict[str, np.ndarray]) -> tuple[list[int], dict]:
        """`MropeVisionRunner`'s tensors, and "input_features" float [mel bins, frames] with
        "audio_frames" int [clips] when the prompt holds audio. ValueError when the audio
        tokens are not the rows the clips make."""
        prompt, inputs = super().make_request(tensors)
        where = np.flatnonzero(np.asarray(prompt) == self.audio_token_id)
        features, frames = tensors.get("input_features"), tensors.get("audio_frames")
        counts = np.zeros(0, dtype=np.int64) if frames is None else np.array(frames, dtype=np.int64).reshape(-1)
        rows = int(sum(audio_rows(int(n), self.n_window) for n in counts))
        width = 0 if features is None else features.shape[1]
        if len(where) != rows or width != int(counts.sum()):
            raise ValueError(f"the prompt holds {len(where)} audio tokens and {width} feature frames; its clips' "
                             f"frames {counts.tolist()} make {rows} rows and {int(counts.sum())} frames")
        seconds = tensors.get("video_seconds")
        if seconds is not None:  # the talker's positions of the prompt's videos (omni_speech.py)
            inputs["video_seconds"] = [float(v) for v in np.asarray(seconds).reshape(-1)]
        if features is not None and rows:
            inputs.update(features=torch.from_numpy(np.array(features, dtype=np.float32)), frames=counts,
                          audio_where=where)
        return prompt, inputs

    def prepare(self, admitted: list[Request], pages: dict[str, dict[str, list[int]]]) -> list[Failure]:
        """Keep each request's positions on it, then encode its images and clips."""
        for r in admitted:
            r.metadata["mrope_positions"] = r.inputs["mrope"]
            r.metadata["mrope_delta"] = r.inputs["mrope_delta"]
        todo = [r for r in admitted if r.inputs.get("pixels") is not None or r.inputs.get("features") is not None]
        try:
            with all_cores(self.device):
                self._encode([r for r in todo if r.inputs.get("pixels") is not None])
                for r in todo:
                    if r.inputs.get("features") is not None:
                        self._encode_audio(r)
        except Exception as exc:
            log.exception("the vision tower or audio encoder failed on %d request(s)", len(todo))
            return [Failure(r, "internal error in the vision tower or audio encoder", exc) for r in todo]
        return []

    def _encode_audio(self, r: Request) -> None:
        """The request's clips through the audio encoder (all of them, unless the prefix
        cache holds every audio row), merged with its image rows into `r.embeds`."""
        where: np.ndarray = r.inputs["audio_where"]
        if where[-1] < r.num_computed:
            return
        with torch.inference_mode():
            rows = self.model.encode_audio(r.inputs["features"].to(self.device, self.dtype),
                                           torch.from_numpy(r.inputs["frames"]))
        if r.embeds is None:
            r.embeds = (where, rows)
            return
        image_where, image_rows = r.embeds
        rows = torch.nn.functional.pad(rows, (0, image_rows.shape[1] - rows.shape[1]))
        merged = np.concatenate([image_where, where])
        order = np.argsort(merged, kind="stable")
        r.embeds = (merged[order], torch.cat([image_rows, rows])[torch.from_numpy(order).to(rows.device)])
