"""UniPC multistep (diffusers' `UniPCMultistepScheduler`) for flow-matching models, the
configuration Cosmos 3 and Wan ship: flow sigmas shifted by `flow_shift`, x0 prediction
from the velocity, the bh1 / bh2 solvers, the corrector after every step but those in
`disable_corrector`, `lower_order_final`. One instance is one request's state (its
sigmas, its multistep history): the runner makes one per request.

The arithmetic is diffusers' op for op (float32 scalar tensors, the same einsum), so the
latents equal the pipeline's. A scheduler config outside this subset is refused at load.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

#: the config values this port computes; anything else is refused
_REQUIRED = {"use_flow_sigmas": True, "prediction_type": "flow_prediction", "predict_x0": True,
             "use_dynamic_shifting": False, "thresholding": False, "use_karras_sigmas": False,
             "use_exponential_sigmas": False, "use_beta_sigmas": False}


def check_config(c: Mapping[str, Any]) -> None:
    """ValueError naming the first setting this port does not compute."""
    for key, want in _REQUIRED.items():
        if c.get(key, want) != want:
            raise ValueError(f"scheduler_config.json: {key}={c.get(key)!r} is not served (UniPC with {want!r})")
    if c.get("solver_type", "bh2") not in ("bh1", "bh2") or c.get("shift_terminal") or c.get("solver_p"):
        raise ValueError("scheduler_config.json: only UniPC's bh1 / bh2 solvers without shift_terminal are served")
    if c.get("final_sigmas_type", "zero") not in ("zero", "sigma_min"):
        raise ValueError(f"scheduler_config.json: final_sigmas_type {c.get('final_sigmas_type')!r} is not served")


def _alpha_sigma(sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return 1 - sigma, sigma


def _lambda(sigma: torch.Tensor) -> torch.Tensor:
    alpha, s = _alpha_sigma(sigma)
    return torch.log(alpha) - torch.log(s)


class UniPC:
    def __init__(self, c: Mapping[str, Any], steps: int, device: torch.device | str = "cpu") -> None:
        self.order = int(c.get("solver_order", 2))
        self.bh2 = c.get("solver_type", "bh2") == "bh2"
        self.lower_order_final = bool(c.get("lower_order_final", True))
        self.disable_corrector = list(c.get("disable_corrector") or [])
        n = int(c.get("num_train_timesteps", 1000))
        shift = float(c.get("flow_shift", 1.0))
        sigmas = np.linspace(1, 1 / n, steps + 1)[:-1]
        sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
        if np.fabs(sigmas[0] - 1) < 1e-6:
            sigmas[0] -= 1e-6
        timesteps = (sigmas * n).copy()
        last = sigmas[-1] if c.get("final_sigmas_type", "zero") == "sigma_min" else 0
        self.sigmas = torch.from_numpy(np.concatenate([sigmas, [last]]).astype(np.float32))
        self.timesteps = torch.from_numpy(timesteps).to(device=device, dtype=torch.int64)
        self.outputs: list[torch.Tensor | None] = [None] * self.order
        self.lower_order_nums, self.index, self.this_order = 0, 0, 1
        self.last_sample: torch.Tensor | None = None

    def step(self, velocity: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        """The next sample from this step's velocity (`UniPCMultistepScheduler.step`)."""
        x0 = sample - self.sigmas[self.index] * velocity
        if self.index > 0 and self.index - 1 not in self.disable_corrector and self.last_sample is not None:
            sample = self._corrector(x0, self.last_sample, sample, self.this_order)
        self.outputs = [*self.outputs[1:], x0]
        order = min(self.order, len(self.timesteps) - self.index) if self.lower_order_final else self.order
        self.this_order = min(order, self.lower_order_nums + 1)
        self.last_sample = sample
        out = self._predictor(sample, self.this_order)
        self.lower_order_nums = min(self.lower_order_nums + 1, self.order)
        self.index += 1
        return out

    def _coefficients(self, h: torch.Tensor, rks: list[torch.Tensor], order: int, device: torch.device
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(R, b, h_phi_1, B_h) of `multistep_uni_*_bh_update`."""
        rk = torch.stack([*rks, torch.ones((), device=device)])
        hh = -h
        h_phi_1 = torch.expm1(hh)
        h_phi_k = h_phi_1 / hh - 1
        factorial = 1
        b_h = torch.expm1(hh) if self.bh2 else hh
        big_r, b = [], []
        for i in range(1, order + 1):
            big_r.append(torch.pow(rk, i - 1))
            b.append(h_phi_k * factorial / b_h)
            factorial *= i + 1
            h_phi_k = h_phi_k / hh - 1 / factorial
        return torch.stack(big_r), torch.stack(b), h_phi_1, b_h

    def _history(self, first: int, lambda_s0: torch.Tensor, h: torch.Tensor, m0: torch.Tensor, order: int,
                 device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        rks, d1s = [], []
        for i in range(1, order):
            mi = self.outputs[-(i + 1)]
            assert mi is not None
            rk = (_lambda(self.sigmas[first - i].to(device)) - lambda_s0) / h
            rks.append(rk)
            d1s.append((mi - m0) / rk)
        return rks, d1s

    def _predictor(self, x: torch.Tensor, order: int) -> torch.Tensor:
        device = x.device
        m0 = self.outputs[-1]
        assert m0 is not None
        sigma_t, sigma_s0 = self.sigmas[self.index + 1].to(device), self.sigmas[self.index].to(device)
        alpha_t, sigma_t = _alpha_sigma(sigma_t)
        _, sigma_s0 = _alpha_sigma(sigma_s0)
        lambda_s0 = _lambda(self.sigmas[self.index].to(device))
        h = (torch.log(alpha_t) - torch.log(sigma_t)) - lambda_s0
        rks, d1s = self._history(self.index, lambda_s0, h, m0, order, device)
        big_r, b, h_phi_1, b_h = self._coefficients(h, rks, order, device)
        x_t = sigma_t / sigma_s0 * x - alpha_t * h_phi_1 * m0
        if d1s:
            if order == 2:
                rhos = torch.ones(1, dtype=x.dtype, device=device) * 0.5
            else:
                rhos = torch.linalg.solve(big_r[:-1, :-1], b[:-1]).to(device).to(x.dtype)
            x_t = x_t - alpha_t * b_h * torch.einsum("k,bkc...->bc...", rhos, torch.stack(d1s, dim=1))
        else:
            x_t = x_t - alpha_t * b_h * 0
        return x_t.to(x.dtype)

    def _corrector(self, model_t: torch.Tensor, x: torch.Tensor, this: torch.Tensor, order: int) -> torch.Tensor:
        device = this.device
        m0 = self.outputs[-1]
        assert m0 is not None
        sigma_t, sigma_s0 = self.sigmas[self.index].to(device), self.sigmas[self.index - 1].to(device)
        alpha_t, sigma_t = _alpha_sigma(sigma_t)
        _, sigma_s0 = _alpha_sigma(sigma_s0)
        lambda_s0 = _lambda(self.sigmas[self.index - 1].to(device))
        h = (torch.log(alpha_t) - torch.log(sigma_t)) - lambda_s0
        rks, d1s = self._history(self.index - 1, lambda_s0, h, m0, order, device)
        big_r, b, h_phi_1, b_h = self._coefficients(h, rks, order, device)
        rhos = (torch.ones(1, dtype=x.dtype, device=device) * 0.5 if order == 1
                else torch.linalg.solve(big_r, b).to(device).to(x.dtype))
        x_t = sigma_t / sigma_s0 * x - alpha_t * h_phi_1 * m0
        corr = torch.einsum("k,bkc...->bc...", rhos[:-1], torch.stack(d1s, dim=1)) if d1s else 0
        return (x_t - alpha_t * b_h * (corr + rhos[-1] * (model_t - m0))).to(x.dtype)
