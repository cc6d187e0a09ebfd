"""SigLIP vision tower and Idefics3 connector against transformers, with random weights.

Tiny Idefics3 / SmolVLM / Gemma 3 models get random parameters (all of them, biases and norms
included, large enough that nothing is negligible); their state dicts load into our modules by
prefix, and the outputs must match transformers' eager implementation.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from services.gpu_worker.modeling.vision.siglip import (
    Idefics3Connector,
    SiglipVisionTower,
    bucketed_position_ids,
    load_prefixed,
    pixel_shuffle,
)

VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_channels": 3,
    "image_size": 32,
    "patch_size": 8,
    "layer_norm_eps": 1e-6,
    "hidden_act": "gelu_pytorch_tanh",
}
LLAMA = {
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}
GEMMA3_TEXT = {**LLAMA, "model_type": "gemma3_text", "head_dim": 32}


def _randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Every parameter N(0, 0.3^2), norm weights around 1: not tiny, and biases are not zero."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.3
            p.copy_(noise + 1.0 if "norm" in name and name.endswith("weight") else noise)
    return model.eval()


def _hf(cls: type, config: transformers.PretrainedConfig) -> nn.Module:
    config._attn_implementation = "eager"
    return _randomize(cls(config))


def _pixels(n: int = 3, size: int = 32) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(1))


def _idefics3(vision: dict | None = None, cls_name: str = "Idefics3") -> nn.Module:
    config_cls = getattr(transformers, f"{cls_name}Config")
    config = config_cls(vision_config=vision or VISION, text_config=LLAMA, scale_factor=2)
    return _hf(getattr(transformers, f"{cls_name}ForConditionalGeneration"), config)


@pytest.mark.parametrize("name", ["Idefics3", "SmolVLM"])
def test_idefics3_family_tower_and_connector_match(name: str) -> None:
    model = _idefics3(cls_name=name)
    state = model.state_dict()
    tower = SiglipVisionTower(VISION, bucketed_positions=True)
    connector = Idefics3Connector(32, 64, scale_factor=2)
    load_prefixed(tower, state, "model.vision_model.")
    load_prefixed(connector, state, "model.connector.")
    pixels = _pixels()
    with torch.no_grad():
        want = model.model.vision_model(pixels).last_hidden_state
        want_proj = model.model.connector(want)
        got = tower(pixels)
        got_proj = connector(got)
    assert got.shape == (3, 16, 32) and got_proj.shape == (3, 4, 64)
    assert want.abs().mean() > 0.1 and want_proj.abs().mean() > 0.1
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_proj, want_proj, atol=1e-5, rtol=1e-5)


def test_idefics3_bucketed_positions_where_they_are_not_arange() -> None:
    """A 25 x 25 grid: float32 rounding in NaViT's bucketing repeats ids, and we must too."""
    vision = {**VISION, "image_size": 50, "patch_size": 2, "num_hidden_layers": 1}
    assert not torch.equal(bucketed_position_ids(25), torch.arange(625))
    model = _idefics3(vision)
    tower = SiglipVisionTower(vision, bucketed_positions=True)
    load_prefixed(tower, model.state_dict(), "model.vision_model.")
    pixels = _pixels(2, 50)
    with torch.no_grad():
        torch.testing.assert_close(
            tower(pixels), model.model.vision_model(pixels).last_hidden_state, atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize(("side", "scale"), [(4, 2), (6, 3), (8, 4), (6, 2)])
def test_pixel_shuffle_is_transformers_permutation(side: int, scale: int) -> None:
    x = torch.randn(2, side * side, 5)
    ref = transformers.models.idefics3.modeling_idefics3.Idefics3Connector.pixel_shuffle
    smol = transformers.models.smolvlm.modeling_smolvlm.SmolVLMConnector.pixel_shuffle
    assert torch.equal(pixel_shuffle(x, scale), ref(None, x, scale))
    assert torch.equal(pixel_shuffle(x, scale), smol(None, x, scale))


def _gemma3(use_head: bool = False) -> nn.Module:
    vision = {**VISION, "model_type": "siglip_vision_model", "vision_use_head": use_head}
    config = transformers.Gemma3Config(vision_config=vision, text_config=GEMMA3_TEXT, mm_tokens_per_image=4)
    return _hf(transformers.Gemma3ForConditionalGeneration, config)


def test_gemma3_vision_tower_matches() -> None:
    model = _gemma3()
    state = model.state_dict()
    # transformers 5's SiglipVisionModel has no inner `vision_model.`, and Gemma 3 has no head.
    assert "model.vision_tower.embeddings.patch_embedding.weight" in state
    assert not any(k.startswith("model.vision_tower.head.") for k in state)
    tower = SiglipVisionTower({**VISION, "vision_use_head": False})
    load_prefixed(tower, state, "model.vision_tower.")
    pixels = _pixels()
    with torch.no_grad():
        want = model.model.vision_tower(pixel_values=pixels).last_hidden_state
        got = tower(pixels)
    assert want.abs().mean() > 0.1
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bfloat16_close() -> None:
    """In bfloat16 we stay as close to the float32 result as transformers' own bfloat16 run does."""
    reference = _idefics3()
    model = _idefics3().to(torch.bfloat16)
    state = model.state_dict()
    tower = SiglipVisionTower(VISION, bucketed_positions=True).to(torch.bfloat16)
    connector = Idefics3Connector(32, 64, scale_factor=2).to(torch.bfloat16)
    load_prefixed(tower, state, "model.vision_model.")
    load_prefixed(connector, state, "model.connector.")
    pixels = _pixels()
    with torch.no_grad():
        exact = reference.model.connector(reference.model.vision_model(pixels).last_hidden_state)
        want = model.model.connector(model.model.vision_model(pixels.bfloat16()).last_hidden_state).float()
        got = connector(tower(pixels.bfloat16()))
    assert got.dtype == torch.bfloat16
    scale = exact.abs().max().item()
    torch.testing.assert_close(got.float(), want, atol=0.02 * scale, rtol=0)
    assert (got.float() - exact).abs().max() <= 1.5 * (want - exact).abs().max() + 1e-3 * scale


def test_load_prefixed_is_strict() -> None:
    tower = SiglipVisionTower(VISION)
    with pytest.raises(ValueError, match=r"unexpected \['model.vision_tower.head"):
        load_prefixed(tower, _gemma3(use_head=True).state_dict(), "model.vision_tower.")
    state = {f"v.{k}": t for k, t in tower.state_dict().items()}
    del state["v.post_layernorm.bias"]
    with pytest.raises(ValueError, match=r"missing \['v.post_layernorm.bias'\]"):
        load_prefixed(tower, state, "v.")


def test_rejects_other_sizes_and_configs() -> None:
    tower = SiglipVisionTower(VISION)
    with pytest.raises(ValueError, match="full tiles"):
        tower(torch.zeros(1, 3, 24, 32))
    with pytest.raises(ValueError, match="lacks"):
        SiglipVisionTower({k: v for k, v in VISION.items() if k != "patch_size"})
    with pytest.raises(ValueError, match="vision_use_head"):
        SiglipVisionTower({**VISION, "vision_use_head": True})
    with pytest.raises(ValueError, match="square grid"):
        pixel_shuffle(torch.zeros(1, 9, 4), 2)
