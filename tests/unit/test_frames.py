"""Frames: strict tagged unions, tensors as extra frames (no pickle), layouts only on NewRequest."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from shared.frames import (
    Abort,
    FrameCodec,
    NewRequest,
    Output,
    SamplingParams,
    StepOutputs,
    ToApi,
    ToConductor,
    pack_tensors,
    unpack_tensors,
)
from shared.layout import LabelLayout, Span


def _request() -> tuple[NewRequest, list]:
    ids = np.arange(10, dtype=np.int32)
    refs, bufs = pack_tensors({"input_ids": ids})
    layout = {"text": LabelLayout(spans=(Span.ids(ids.tolist()),), growth={"decode_loop": 1})}
    return NewRequest("r1", "m", refs, SamplingParams(temperature=0.0), "ipc:///x", 10, 5, layout), bufs


def test_new_request_round_trip_with_tensor_frames():
    req, bufs = _request()
    codec = FrameCodec(ToConductor)
    frames = codec.encode(req, bufs)
    assert len(frames) == 2 and b"pickle" not in bytes(frames[0])
    msg, views = codec.decode([bytes(f) for f in frames])
    assert msg == req
    tensors = unpack_tensors(msg.input_tensors, views)
    assert tensors["input_ids"].tolist() == list(range(10))


def test_without_layouts_drops_only_layouts():
    req, _ = _request()
    kept = req.without_layouts()
    assert kept.kv_layout == {} and kept.request_id == req.request_id and kept.input_tensors == req.input_tensors


def test_strict_decoding_refuses_unknown_tag_and_wrong_types():
    codec = FrameCodec(ToApi)
    with pytest.raises(msgspec.ValidationError):
        codec.decode([msgspec.msgpack.encode(["no_such_tag", "x"])])
    with pytest.raises(msgspec.ValidationError):
        codec.decode([msgspec.msgpack.encode(["step_outputs", [["r", "not-a-list"]]])])
    # Abort is not a frame the api receives.
    with pytest.raises(msgspec.ValidationError):
        codec.decode(FrameCodec(ToApi).encode(Abort("r")))


def test_one_frame_carries_a_whole_step():
    outs = StepOutputs([Output(f"r{i}", [i], None, 3, 1) for i in range(64)])
    codec = FrameCodec(ToApi)
    frames = codec.encode(outs)
    assert len(frames) == 1
    assert codec.decode(frames)[0] == outs


def test_tensor_ref_out_of_range_is_an_error():
    req, _ = _request()
    with pytest.raises(ValueError, match="missing frame"):
        unpack_tensors(req.input_tensors, [])
