"""Cosmos 3 on the real engine in process (no services): four requests in one step (an
image under CFG, one without, a negative prompt with the second sample of its seed, a
5-frame video), each equal to the diffusers pipeline's frames for the same seed, steps,
guidance and size; pages back to zero. tests/e2e/test_image_gen.py does it through the
services.

The loop runs one iteration a worker step (runners/loop_steps.py): a 1-step image that
arrives while a 6-step one runs ends first, in the next step (it does not wait for the
long loop), while the long one's progress outputs count its iterations one a step; the
long one's pixels are the same as when it runs alone (its UniPC history carried exactly
across steps, whoever shares them); an abort between iterations frees its pages."""

from __future__ import annotations

import numpy as np
import pytest

from shared.frames import NewRequest, SamplingParams, pack_tensors
from shared.specs.base import PromptRequest
from tests.cosmos_checkpoints import load_pipeline, make_cosmos3, reference_frames, to_uint8
from tests.engines import folder_engine

CASES = [dict(prompt="a red fox", height=32, width=32, num_frames=1, guidance_scale=6.0, negative_prompt=None, seed=3,
              sample=0),
         dict(prompt="a red fox", height=32, width=48, num_frames=1, guidance_scale=1.0, negative_prompt=None, seed=4,
              sample=0),
         dict(prompt="the quick dog", height=32, width=32, num_frames=1, guidance_scale=4.0, negative_prompt="blurry",
              seed=3, sample=1),
         dict(prompt="a video", height=32, width=32, num_frames=5, guidance_scale=6.0, negative_prompt=None, seed=7,
              sample=0)]
STEPS = 3


@pytest.fixture(scope="module")
def cosmos_dir(tmp_path_factory):
    return make_cosmos3(tmp_path_factory.mktemp("cosmos3") / "tiny-cosmos3")


def _request(spec, tok, case: dict) -> PromptRequest:
    """What the data worker hands the spec: both prompts' ids, the options."""
    cond, uncond = spec.prompt_texts(case["prompt"], case["negative_prompt"], case["height"], case["width"],
                                     case["num_frames"])
    ci = tok.encode(cond, add_special_tokens=False).ids + spec.suffix_ids
    ui = tok.encode(uncond, add_special_tokens=False).ids + spec.suffix_ids
    options = {k: case[k] for k in ("height", "width", "num_frames", "guidance_scale", "seed", "sample")}
    return PromptRequest(ci + ui, options={**options, "cond_rows": len(ci), "num_inference_steps": STEPS})


def test_engine_equals_pipeline(cosmos_dir):
    src, spec, pools, kv, eng = folder_engine(cosmos_dir, 4096)
    caps = spec.clamp_caps(spec.get_loop_caps(1))
    for i, case in enumerate(CASES):
        ppo = spec.process_prompt(_request(spec, src.tokenizer.tokenizer, case))
        refs, _ = pack_tensors(ppo.new_input_tensors)
        rows = len(ppo.new_input_tensors["input_ids"])
        eng.add(NewRequest(f"r{i}", "", refs, SamplingParams(), "", rows, 1, ppo.kv_layout, caps,
                           spec.kv_configs(ppo.kv_layout, caps, pools)), ppo.new_input_tensors)
    got: dict[str, bytes] = {}
    steps = 0
    while eng.has_work:
        steps += 1
        for _, out in eng.step().outputs:
            if out.pooled:
                got[out.request_id] = out.pooled
    assert steps == STEPS and kv.used_pages() == 0  # a step per iteration, every request's in one
    assert eng.runner.denoise_steps == STEPS * len(CASES)
    pipe = load_pipeline(cosmos_dir)
    firsts = []
    for i, case in enumerate(CASES):
        ref = reference_frames(pipe, case["prompt"], height=case["height"], width=case["width"],
                               num_frames=case["num_frames"], seed=case["seed"], steps=STEPS,
                               guidance_scale=case["guidance_scale"], negative_prompt=case["negative_prompt"],
                               n=case["sample"] + 1)[-1]
        if case["num_frames"] == 1:  # an image's float32; a video's uint8, rounded as numpy_to_pil
            mine = np.frombuffer(got[f"r{i}"], dtype="<f4").reshape(ref.shape)
            assert np.abs(mine - ref).max() < 1e-4, i
            mine = to_uint8(mine)
        else:
            mine = np.frombuffer(got[f"r{i}"], dtype=np.uint8).reshape(ref.shape)
        assert np.abs(mine.astype(int) - to_uint8(ref)).max() <= 1, i
        firsts.append(mine[0, :32, :32])
    assert not np.array_equal(firsts[0], firsts[2])  # the prompt and the noise reach the pixels


LONG, SHORT = 6, 1


@pytest.fixture(scope="module")
def engine(cosmos_dir):
    src, spec, pools, _, eng = folder_engine(cosmos_dir, 4096)
    return eng, spec, src.tokenizer.tokenizer, pools


def _add(engine, request_id: str, prompt: str, steps: int, seed: int) -> None:
    eng, spec, tok, pools = engine
    cond, uncond = spec.prompt_texts(prompt, None, 32, 32, 1)
    ci = tok.encode(cond, add_special_tokens=False).ids + spec.suffix_ids
    ui = tok.encode(uncond, add_special_tokens=False).ids + spec.suffix_ids
    options = dict(height=32, width=32, num_frames=1, guidance_scale=5.0, seed=seed, sample=0, cond_rows=len(ci),
                   num_inference_steps=steps)
    ppo = spec.process_prompt(PromptRequest(ci + ui, options=options))
    caps = spec.clamp_caps(spec.get_loop_caps(1))
    refs, _ = pack_tensors(ppo.new_input_tensors)
    eng.add(NewRequest(request_id, "", refs, SamplingParams(), "", len(ppo.new_input_tensors["input_ids"]), 1,
                       ppo.kv_layout, caps, spec.kv_configs(ppo.kv_layout, caps, pools)), ppo.new_input_tensors)


def _step(eng, log: list[tuple[int, str, int, int]], results: dict[str, bytes], n: int) -> None:
    """Step `n` times: each output as (step, request, steps done, of), results by request."""
    for _ in range(n):
        for _, out in eng.step().outputs:
            log.append((eng.runner.denoise_steps, out.request_id, out.steps_done, out.steps_total))
            if out.pooled:
                results[out.request_id] = out.pooled


def test_short_request_ends_while_long_one_runs(engine):
    eng, kv = engine[0], engine[0].kv
    alone: dict[str, bytes] = {}
    _add(engine, "alone", "a red fox", LONG, 3)
    _step(eng, [], alone, LONG)
    assert not eng.has_work and "alone" in alone and kv.used_pages() == 0  # one iteration a step

    log: list[tuple[int, str, int, int]] = []
    got: dict[str, bytes] = {}
    _add(engine, "long", "a red fox", LONG, 3)
    _step(eng, log, got, 3)
    _add(engine, "short", "a blue cat", SHORT, 4)
    _step(eng, log, got, 1)  # the short one's prompt and its one iteration, beside the long one's 4th
    assert "short" in got and "long" not in got and eng.running[0].request_id == "long"
    while eng.has_work:
        _step(eng, log, got, 1)
    long = [(done, total) for _, rid, done, total in log if rid == "long"]
    assert long == [(i, LONG) for i in range(1, LONG + 1)]  # progress a step, the last with the frames
    assert [(d, t) for _, rid, d, t in log if rid == "short"] == [(SHORT, SHORT)]
    mine = np.frombuffer(got["long"], dtype="<f4")
    assert np.abs(mine - np.frombuffer(alone["alone"], dtype="<f4")).max() < 1e-5
    assert kv.used_pages() == 0 and eng.runner.denoise_steps == 2 * LONG + SHORT


def test_abort_between_iterations_frees_its_pages(engine):
    eng, kv = engine[0], engine[0].kv
    _add(engine, "gone", "a red fox", LONG, 5)
    _step(eng, [], {}, 2)
    assert kv.used_pages() > 0 and eng.running[0].loop.done == 2
    assert eng.abort("gone") is not None
    assert not eng.has_work and kv.used_pages() == 0
