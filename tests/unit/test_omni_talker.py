"""Qwen3-Omni's speech stage (runners/omni_talker.py, modeling/speech/qwen3_omni_talker.py,
codecs/code2wav.py) against transformers' `generate(return_audio=True)` (greedy, float32) on
a tiny random checkpoint: given the thinker's sequence, the talker's frames equal the codes
transformers hands Code2Wav, and the waveform its waveform, for a text-only prompt, on
paged KV (the code predictor's rows rewritten in the same pages every frame)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from services.gpu_worker.codecs.code2wav import Code2WavCodec
from services.gpu_worker.kv_memory import kv_cache
from services.gpu_worker.modeling.speech.qwen3_omni_talker import Qwen3OmniTalker
from services.gpu_worker.runners.omni_talker import TalkerRun, TalkerSettings, talker_prompt
from tests.omni_checkpoints import make_omni_checkpoint, omni_processor

PAGE = 4
MAX_FRAMES = 9


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_omni_checkpoint(tmp_path_factory.mktemp("omni") / "omni")


def _reference(ckpt, voice: str, max_tokens: int):
    import transformers

    model = transformers.Qwen3OmniMoeForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    proc = omni_processor(ckpt)
    text = proc.apply_chat_template([{"role": "user", "content": "Say hello to the world"}],
                                    add_generation_prompt=True, tokenize=False)
    inputs = proc(text=text, return_tensors="pt")
    seen = {}
    decode = model.code2wav.chunked_decode

    def capture(codes, **kw):
        seen["codes"] = codes[0].T.numpy()
        return decode(codes, **kw)

    model.code2wav.chunked_decode = capture
    eos = proc.tokenizer.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        seq, wav = model.generate(**inputs, speaker=voice, thinker_max_new_tokens=max_tokens, thinker_do_sample=False,
                                  talker_do_sample=False, return_audio=True, talker_max_new_tokens=MAX_FRAMES + 1,
                                  thinker_eos_token_id=eos)
    embed = model.thinker.get_input_embeddings()
    return seq[0].tolist(), inputs["input_ids"].shape[1], seen["codes"], wav.reshape(-1).numpy(), embed, eos


def _ours(ckpt, sequence, prompt_len, voice, embed, eos):
    from safetensors.torch import load_file

    config = json.loads((ckpt / "config.json").read_text())
    model = Qwen3OmniTalker(config)
    model.load_weights(load_file(str(ckpt / "model.safetensors")))
    model.reset_buffers()
    model.eval()
    s = TalkerSettings.from_config(config)
    tc, pc = model.cfg, model.predictor_cfg
    talker_caches = kv_cache(tc.num_hidden_layers, 16, PAGE, tc.num_key_value_heads, tc.head_dim, torch.float32,
                             torch.device("cpu"))
    code_caches = kv_cache(pc.num_hidden_layers, 4, PAGE, pc.num_key_value_heads, pc.head_dim, torch.float32,
                           torch.device("cpu"))
    with torch.inference_mode():
        prompt = talker_prompt(model, s, embed, sequence, prompt_len, s.speakers[voice], (eos,))
        run = TalkerRun(model, s, prompt, talker_caches, code_caches, PAGE)
        pages = list(range(16))
        code = run.prefill(pages)
        frames = []
        while code != s.codec_eos and len(run.history) <= MAX_FRAMES:
            frame, code = run.frame(pages, [0, 1])
            frames.append(frame)
    codec = Code2WavCodec(ckpt, config["code2wav_config"])
    codes = np.asarray(frames, dtype=np.int64)
    return codes, codec.decode(codes)


@pytest.mark.parametrize(("voice", "max_tokens"), [("ethan", 6), ("chelsie", 3)])
def test_codes_and_waveform_equal_transformers(ckpt, voice, max_tokens):
    sequence, prompt_len, ref_codes, ref_wave, embed, eos = _reference(ckpt, voice, max_tokens)
    codes, wave = _ours(ckpt, sequence, prompt_len, voice, embed, eos)
    assert len(codes) and codes.tolist() == ref_codes.tolist()
    assert wave.shape == ref_wave.shape
    np.testing.assert_allclose(wave, ref_wave, atol=1e-3)
