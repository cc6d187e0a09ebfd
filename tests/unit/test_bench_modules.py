"""The request benches import and parse their flags (their runs are e2e: tests/e2e/test_bench.py
runs `bench.world --quick`; `bench.image_gen` runs take minutes, so only their parsing here)."""

from __future__ import annotations

import importlib


def test_request_benches_import_and_parse():
    for name in ("bench.rounds", "bench.world", "bench.image_gen", "bench.policy"):
        importlib.import_module(name)
    from bench import image_gen, world

    args = image_gen.parser().parse_args(["--family", "bagel", "--quick"])
    assert args.family == "bagel" and image_gen.FAMILIES["bagel"][2] == "bagel2"
    assert world.parser().parse_args(["--quick", "--rounds", "1"]).rounds == 1
    assert [f.key for f in world.FIGURES][-1] == "one_clip_8_s"


def test_image_gen_frames_flag():
    """`--frames N` videos for Cosmos 3 only; 1 (images) by default."""
    import pytest

    from bench import image_gen

    assert image_gen.parser().parse_args([]).frames == 1
    assert image_gen.parser().parse_args(["--frames", "5"]).frames == 5
    assert [f.name for f in image_gen.figures(5)] == ["c1 s/video", f"c{image_gen.BURST} s/video"]
    with pytest.raises(SystemExit):
        image_gen.main(["--family", "bagel", "--frames", "5"])
