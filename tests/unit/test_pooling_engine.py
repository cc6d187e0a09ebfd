"""The pooling engine in process against transformers: random-weight BERT checkpoints
(a bare encoder, mean-pooled; a cross-encoder, whose text pair gets token types 0 and 1
and whose score is the sigmoid of its logit, as `CrossEncoder.predict`), whole prompts
only, pages back to zero."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.frames import NewRequest, SamplingParams, pack_tensors
from shared.model_source import ModelSource
from shared.specs.base import PromptRequest
from tests.engines import folder_engine

transformers = pytest.importorskip("transformers")


def checkpoint(path, arch: str):
    cfg = transformers.BertConfig(vocab_size=120, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=96, max_position_embeddings=64, num_labels=1,
                                  architectures=[arch])
    torch.manual_seed(0)
    cls = transformers.BertForSequenceClassification if arch == "BertForSequenceClassification" \
        else transformers.BertModel
    model = cls(cfg).eval()
    model.save_pretrained(path)
    return model


def run(path, prompts: list[tuple[list[int], int | None]], budget: int = 512):
    _, spec, pools, kv, eng = folder_engine(path, budget)
    for i, (ids, pair_start) in enumerate(prompts):
        ppo = spec.process_prompt(PromptRequest(ids, options={} if pair_start is None else {"pair_start": pair_start}))
        refs, _ = pack_tensors(ppo.new_input_tensors)
        eng.add(NewRequest(f"r{i}", "", refs, SamplingParams(), "", len(ids), 1, ppo.kv_layout, {},
                           spec.kv_configs(ppo.kv_layout, {}, pools)), ppo.new_input_tensors)
    got, steps = {}, 0
    while eng.has_work:
        res = eng.step()
        steps += 1
        for _, o in res.outputs:
            assert o.finish_reason == "stop" and o.token_ids == []
            got[o.request_id] = np.frombuffer(o.pooled, "<f4")
    assert kv.used_pages() == 0
    return [got[f"r{i}"] for i in range(len(prompts))], steps


def test_encoder_mean_pooling_equals_transformers(tmp_path):
    ref_model = checkpoint(tmp_path, "BertModel")
    prompts = [[2, 5, 9, 3], list(range(3, 58)), list(range(60, 70))]
    got, steps = run(tmp_path, [(p, None) for p in prompts], budget=64)
    assert steps == 2  # whole prompts: the third waits for a step with room for all of it
    with torch.no_grad():
        for ids, vec in zip(prompts, got):
            ref = ref_model(torch.tensor([ids])).last_hidden_state[0].mean(0).numpy()
            np.testing.assert_allclose(vec, ref, rtol=1e-5, atol=1e-5)


def test_cross_encoder_scores_equal_transformers(tmp_path):
    ref_model = checkpoint(tmp_path, "BertForSequenceClassification")
    pairs = [([1, 4, 6, 2], [8, 9, 2]), ([1, 30, 2], [50, 51, 52, 53, 2])]
    got, _ = run(tmp_path, [(a + b, len(a)) for a, b in pairs])
    with torch.no_grad():
        for (a, b), score in zip(pairs, got):
            types = torch.tensor([[0] * len(a) + [1] * len(b)])
            logit = ref_model(torch.tensor([a + b]), token_type_ids=types).logits[0]
            np.testing.assert_allclose(score, torch.sigmoid(logit).numpy(), rtol=1e-5, atol=1e-6)


def test_qwen3_embedding_shaped_folder_equals_last_token_pooling(tmp_path):
    """A Qwen3-Embedding folder: config says Qwen3ForCausalLM, the weights are the bare
    model's (no `model.` prefix, no lm_head), sentence-transformers' modules pool the last
    token and normalize. Equals transformers' last hidden state of the last token, normalized."""
    import json

    from safetensors.torch import load_file, save_file

    from tests.checkpoints import make_checkpoint

    folder = make_checkpoint(tmp_path / "q3", "qwen3")
    full = transformers.Qwen3ForCausalLM.from_pretrained(folder).eval()
    state = load_file(str(folder / "model.safetensors"))
    save_file({k.removeprefix("model."): v.contiguous() for k, v in state.items() if k != "lm_head.weight"},
              str(folder / "model.safetensors"))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}))
    prompts = [[5, 6, 7, 8, 9], list(range(10, 40)), [3]]
    got, _ = run(folder, [(p, None) for p in prompts])
    with torch.no_grad():
        for ids, vec in zip(prompts, got):
            last = full.model(torch.tensor([ids])).last_hidden_state[0, -1]
            np.testing.assert_allclose(vec, torch.nn.functional.normalize(last, dim=-1).numpy(), rtol=1e-5, atol=1e-6)
    spec = ModelSource(str(folder)).spec(16)
    assert (spec.task, spec.pooling, spec.normalize, spec.engine) == ("embed", "last", True, "pooling")
