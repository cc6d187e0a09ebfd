"""The three networks Chatterbox runs over a reference clip (`ChatterboxTTS.prepare_conditionals`),
as functions of their checkpoint tensors (no chatterbox / s3tokenizer package at serve time):

- `voice_encoder`: the package's `VoiceEncoder` (ve.safetensors): a 3-layer LSTM over
  160-frame partials of a 40-band mel, the last layer's state projected, ReLU, L2-normed,
  averaged over the partials and L2-normed again -> T3's speaker embedding [1, 256];
- `campplus`: S3Gen's x-vector encoder `CAMPPlus` (s3gen.safetensors `speaker_encoder.*`):
  the FCM 2-D front, the TDNN, three CAM dense blocks with transits, statistics pooling
  and the dense layer -> [1, 192]; BatchNorms in eval form (their running statistics);
- `s3_tokens`: the S3 tokenizer v2 (`S3TokenizerV2.quantize`, s3gen.safetensors
  `tokenizer.*`): two strided convs, FSMN attention blocks with rotary positions, and
  the FSQ quantizer (8 ternary digits) -> speech tokens, 25 a second.

The features each reads are in modeling/speech/chatterbox_clip.py.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

Weights = dict[str, torch.Tensor]

# -- the voice encoder ------------------------------------------------------------------

VE_PARTIAL = 160  # frames a partial
VE_STEP = int(np.round((16000 / 1.3) / VE_PARTIAL))  # the package's rate 1.3 -> 77 frames
VE_MIN_COVERAGE = 0.8


def ve_partials(mel: torch.Tensor) -> torch.Tensor:
    """[T, 40] -> [n, 160, 40]: `get_num_wins` windows, the last zero-padded if it covers
    at least 80% of a partial (else dropped; one window at least)."""
    n, rem = divmod(max(mel.shape[0] - VE_PARTIAL + VE_STEP, 0), VE_STEP)
    if n == 0 or (rem + (VE_PARTIAL - VE_STEP)) / VE_PARTIAL >= VE_MIN_COVERAGE:
        n += 1
    target = VE_PARTIAL + VE_STEP * (n - 1)
    if target > mel.shape[0]:
        mel = torch.cat([mel, mel.new_zeros(target - mel.shape[0], mel.shape[1])])
    return torch.stack([mel[i * VE_STEP: i * VE_STEP + VE_PARTIAL] for i in range(n)])


def voice_encoder(lstm: torch.nn.LSTM, w: Weights, mel: torch.Tensor) -> torch.Tensor:
    """The speaker embedding [1, 256] of a clip's voice-encoder mel [T, 40]."""
    _, (hidden, _) = lstm(ve_partials(mel))
    raw = F.relu(F.linear(hidden[-1], w["proj.weight"], w["proj.bias"]))
    partial = raw / torch.linalg.norm(raw, dim=1, keepdim=True)
    mean = partial.mean(dim=0, keepdim=True)
    return mean / torch.linalg.norm(mean, dim=1, keepdim=True)


def make_lstm(w: Weights) -> torch.nn.LSTM:
    """ve.safetensors' LSTM (`lstm.*`), its sizes read from the tensors."""
    layers = sum(1 for k in w if k.startswith("lstm.weight_ih_l"))
    hidden, inputs = w["lstm.weight_ih_l0"].shape[0] // 4, w["lstm.weight_ih_l0"].shape[1]
    lstm = torch.nn.LSTM(inputs, hidden, num_layers=layers, batch_first=True)
    lstm.load_state_dict({k[len("lstm."):]: v for k, v in w.items() if k.startswith("lstm.")})
    return lstm.eval()


# -- CAMPPlus ---------------------------------------------------------------------------


def _bn(x: torch.Tensor, w: Weights, p: str) -> torch.Tensor:
    return F.batch_norm(x, w[p + ".running_mean"], w[p + ".running_var"], w.get(p + ".weight"), w.get(p + ".bias"),
                        False, 0.0, 1e-5)


def _res_block(x: torch.Tensor, w: Weights, p: str, stride: int) -> torch.Tensor:
    out = F.relu(_bn(F.conv2d(x, w[p + ".conv1.weight"], stride=(stride, 1), padding=1), w, p + ".bn1"))
    out = _bn(F.conv2d(out, w[p + ".conv2.weight"], padding=1), w, p + ".bn2")
    if p + ".shortcut.0.weight" in w:
        x = _bn(F.conv2d(x, w[p + ".shortcut.0.weight"], stride=(stride, 1)), w, p + ".shortcut.1")
    return F.relu(out + x)


def _fcm(x: torch.Tensor, w: Weights) -> torch.Tensor:
    """The 2-D front ("head"): [B, 80, T] -> [B, channels * 10, T]."""
    out = F.relu(_bn(F.conv2d(x.unsqueeze(1), w["head.conv1.weight"], padding=1), w, "head.bn1"))
    for layer in ("head.layer1", "head.layer2"):
        i = 0
        while f"{layer}.{i}.conv1.weight" in w:
            out = _res_block(out, w, f"{layer}.{i}", 2 if i == 0 else 1)
            i += 1
    out = F.relu(_bn(F.conv2d(out, w["head.conv2.weight"], stride=(2, 1), padding=1), w, "head.bn2"))
    return out.reshape(out.shape[0], out.shape[1] * out.shape[2], out.shape[3])


def _seg_pool(x: torch.Tensor, seg: int = 100) -> torch.Tensor:
    pooled = F.avg_pool1d(x, kernel_size=seg, stride=seg, ceil_mode=True)
    return pooled.unsqueeze(-1).expand(*pooled.shape, seg).reshape(*pooled.shape[:-1], -1)[..., : x.shape[-1]]


def _cam_dense_layer(x: torch.Tensor, w: Weights, p: str, dilation: int) -> torch.Tensor:
    h = F.conv1d(F.relu(_bn(x, w, p + ".nonlinear1.batchnorm")), w[p + ".linear1.weight"])
    h = F.relu(_bn(h, w, p + ".nonlinear2.batchnorm"))
    c = p + ".cam_layer"
    y = F.conv1d(h, w[c + ".linear_local.weight"], padding=dilation, dilation=dilation)
    context = h.mean(-1, keepdim=True) + _seg_pool(h)
    context = F.relu(F.conv1d(context, w[c + ".linear1.weight"], w[c + ".linear1.bias"]))
    return y * torch.sigmoid(F.conv1d(context, w[c + ".linear2.weight"], w[c + ".linear2.bias"]))


def campplus(w: Weights, fbank: torch.Tensor) -> torch.Tensor:
    """The x-vector [1, 192] of Kaldi fbank features [T, 80] (their mean removed)."""
    x = _fcm(fbank.t().unsqueeze(0), w)
    x = F.relu(_bn(F.conv1d(x, w["xvector.tdnn.linear.weight"], stride=2, padding=2), w,
                   "xvector.tdnn.nonlinear.batchnorm"))
    for b, dilation in ((1, 1), (2, 2), (3, 2)):
        j = 1
        while f"xvector.block{b}.tdnnd{j}.linear1.weight" in w:
            x = torch.cat([x, _cam_dense_layer(x, w, f"xvector.block{b}.tdnnd{j}", dilation)], dim=1)
            j += 1
        t = f"xvector.transit{b}"
        x = F.conv1d(F.relu(_bn(x, w, t + ".nonlinear.batchnorm")), w[t + ".linear.weight"])
    x = F.relu(_bn(x, w, "xvector.out_nonlinear.batchnorm"))
    stats = torch.cat([x.mean(dim=-1), x.std(dim=-1, unbiased=True)], dim=-1)
    out = F.conv1d(stats.unsqueeze(-1), w["xvector.dense.linear.weight"]).squeeze(-1)
    return _bn(out, w, "xvector.dense.nonlinear.batchnorm")


# -- the S3 tokenizer (v2) --------------------------------------------------------------


def _rotary(length: int, dim: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """`precompute_freqs_cis(64, ...)`'s cos / sin, both halves alike: [T, 64]."""
    freqs = 1.0 / (10000.0 ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    angles = torch.outer(torch.arange(length).float(), freqs)
    cis = torch.polar(torch.ones_like(angles), angles)
    cis = torch.view_as_real(torch.cat((cis, cis), dim=-1))
    return cis[..., 0], cis[..., 1]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[None, :, None] + turned * sin[None, :, None]


def _s3_block(x: torch.Tensor, w: Weights, p: str, heads: int, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    b, t, d = x.shape
    a = p + ".attn"
    h = F.layer_norm(x, (d,), w[p + ".attn_ln.weight"], w[p + ".attn_ln.bias"], 1e-5)
    q = F.linear(h, w[a + ".query.weight"], w[a + ".query.bias"]).view(b, t, heads, -1)
    k = F.linear(h, w[a + ".key.weight"]).view(b, t, heads, -1)
    v = F.linear(h, w[a + ".value.weight"], w[a + ".value.bias"]).view(b, t, heads, -1)
    q, k = _rotate(q, *rope), _rotate(k, *rope)
    flat = v.reshape(b, t, d)
    kernel = w[a + ".fsmn_block.weight"]
    left = (kernel.shape[-1] - 1) // 2
    memory = F.conv1d(F.pad(flat.transpose(1, 2), (left, kernel.shape[-1] - 1 - left)), kernel, groups=d)
    memory = memory.transpose(1, 2) + flat
    scale = (d // heads) ** -0.25
    scores = (q.permute(0, 2, 1, 3) * scale) @ (k.permute(0, 2, 3, 1) * scale)
    att = (torch.softmax(scores.float(), dim=-1) @ v.permute(0, 2, 1, 3)).permute(0, 2, 1, 3).reshape(b, t, d)
    x = x + F.linear(att, w[a + ".out.weight"], w[a + ".out.bias"]) + memory
    h = F.layer_norm(x, (d,), w[p + ".mlp_ln.weight"], w[p + ".mlp_ln.bias"], 1e-5)
    h = F.linear(F.gelu(F.linear(h, w[p + ".mlp.0.weight"], w[p + ".mlp.0.bias"])), w[p + ".mlp.2.weight"],
                 w[p + ".mlp.2.bias"])
    return x + h


def s3_tokens(w: Weights, mel: torch.Tensor, heads: int) -> torch.Tensor:
    """Speech tokens [1, T/4] of one clip's log-mel [128, T] (no padding: every mask is one)."""
    x = F.gelu(F.conv1d(mel.unsqueeze(0), w["encoder.conv1.weight"], w["encoder.conv1.bias"], stride=2, padding=1))
    x = F.gelu(F.conv1d(x, w["encoder.conv2.weight"], w["encoder.conv2.bias"], stride=2, padding=1))
    x = x.permute(0, 2, 1)
    rope = _rotary(x.shape[1])
    i = 0
    while f"encoder.blocks.{i}.attn_ln.weight" in w:
        x = _s3_block(x, w, f"encoder.blocks.{i}", heads, rope)
        i += 1
    down = w["quantizer._codebook.project_down.weight"]
    h = F.linear(x.reshape(-1, x.shape[-1]), down, w["quantizer._codebook.project_down.bias"]).float()
    digits = (h.tanh() * 0.9990000128746033).round() + 1
    powers = torch.pow(3, torch.arange(down.shape[0], dtype=digits.dtype))
    return (digits * powers).sum(-1).reshape(x.shape[0], x.shape[1]).long()


def heads_of(config: dict, state: int) -> int:
    """The tokenizer's heads: the config's, else the package's 20 (64 wide: its rotary
    tables are 64 wide)."""
    return int(config.get("n_audio_head") or max(1, math.ceil(state / 64)))
