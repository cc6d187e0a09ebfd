"""The Wan VAE decoder and UniPC ported into modeling/diffusion/ (so the worker needs no
diffusers) equal diffusers' own, exactly: `AutoencoderKLWan.decode` for Wan 2.2's residual
patchified kind and Wan 2.1's plain one, images and 3-latent-frame videos;
`UniPCMultistepScheduler` over flow sigmas (bh1 and bh2, orders 2 and 3, 1 to 10 steps),
step by step; a config outside the port is refused."""

from __future__ import annotations

import pytest
import torch

from services.gpu_worker.modeling.diffusion.unipc import UniPC, check_config
from services.gpu_worker.modeling.diffusion.wan_vae import WanVAEDecoder
from tests.cosmos_checkpoints import SCHEDULER, VAE

WAN21 = dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[False, True],
             attn_scales=[])


@pytest.mark.parametrize("config", [VAE, WAN21], ids=["wan2.2", "wan2.1"])
def test_vae_decoder_equals_diffusers(config):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    ref = AutoencoderKLWan(**config).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "gamma" in name:
                p.add_(torch.randn_like(p) * 0.2)
    mine = WanVAEDecoder(ref.config)
    state = {k: v for k, v in ref.state_dict().items() if not k.startswith(("encoder.", "quant_conv."))}
    mine.load_state_dict(state, strict=True)
    for frames in (1, 3):
        z = torch.randn(1, config["z_dim"], frames, 4, 6)
        with torch.no_grad():
            assert torch.equal(ref.decode(z).sample, mine(z))


@pytest.mark.parametrize("solver", [("bh2", 2), ("bh1", 2), ("bh2", 3)])
def test_unipc_equals_diffusers(solver):
    from diffusers import UniPCMultistepScheduler

    config = {**SCHEDULER, "solver_type": solver[0], "solver_order": solver[1]}
    for steps in (1, 2, 3, 5, 10):
        ref = UniPCMultistepScheduler(**config)
        ref.set_timesteps(steps)
        mine = UniPC(ref.config, steps)
        assert torch.equal(ref.timesteps, mine.timesteps) and torch.equal(ref.sigmas, mine.sigmas)
        g = torch.Generator().manual_seed(steps)
        a = b = torch.randn(1, 1, 4, 2, 2, 2, generator=g)
        for t in ref.timesteps:
            v = torch.randn(a.shape, generator=g)
            a, b = ref.step(v, t, a, return_dict=False)[0], mine.step(v, b)
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)  # bh1 ends at sigma 0: NaN in both


def test_a_scheduler_outside_the_port_is_refused():
    with pytest.raises(ValueError, match="prediction_type"):
        check_config({**SCHEDULER, "prediction_type": "epsilon"})
