"""FLUX's autoencoder encoder (`flux_ae.FluxEncoder`, what a BAGEL edit's input image goes
through) against the reference's own `AutoEncoder.encoder` / `encode` (bagel2, ByteDance's
copy of FLUX's) on the tiny config of tests/bagel_checkpoints.py, weights random: the
encoder's output bit for bit in float32, the sampled and scaled latents too when the
noise is the numbers the reference's `randn_like` draws (the global generator, seeded)."""

from __future__ import annotations

import pytest
import torch

from services.gpu_worker.modeling.vision.flux_ae import FluxEncoder
from tests.bagel_checkpoints import TINY_AE, _stub_missing


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, FluxEncoder]:
    _stub_missing()
    from bagel2.modeling.autoencoder import AutoEncoder, AutoEncoderParams

    torch.manual_seed(0)
    ref = AutoEncoder(AutoEncoderParams(**TINY_AE)).eval()
    with torch.no_grad():  # off the default init, so every tensor matters (norms and biases too)
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    mine = FluxEncoder(TINY_AE).eval()
    state = {k: v for k, v in ref.state_dict().items() if k.startswith("encoder.")}
    mine.load_state_dict(state, strict=True)
    return ref, mine


@pytest.mark.parametrize("height,width", [(32, 48), (40, 24)])
def test_encoder_equals_the_reference(pair, height: int, width: int) -> None:
    ref, mine = pair
    x = torch.rand(1, 3, height, width, generator=torch.Generator().manual_seed(height)) * 2 - 1
    with torch.no_grad():
        want_moments = ref.encoder(x)
        torch.manual_seed(123)
        want = ref.encode(x)
        torch.manual_seed(123)
        noise = torch.randn(1, TINY_AE["z_channels"], height // 8, width // 8)
        got_moments = mine.encoder(x)
        got = mine.encode(x, noise)
        mean = mine.encode(x)
    assert torch.equal(got_moments, want_moments)
    assert got.shape == (1, TINY_AE["z_channels"], height // 8, width // 8)
    assert (got - want).abs().max().item() <= 1e-5
    ref.reg.sample = False
    try:
        with torch.no_grad():
            want_mean = ref.encode(x)
    finally:
        ref.reg.sample = True
    assert torch.equal(mean, want_mean) and not torch.equal(mean, got)
