"""The runner of hybrid linear-attention models with images (Qwen3.5's
`Qwen3_5ForConditionalGeneration`): `HybridRunner` and `MropeVisionRunner` together.

Method resolution (`HybridVisionRunner`, `HybridRunner`, `MropeVisionRunner`,
`VisionRunner`, `ModelRunner`) gives each part its own hooks, and the two that both
define chain through `super()`:
- `execute`: the hybrid's (copy each prefix hit's state snapshot into its slot), then the
  vision runner's (keep the plan for `_metadata`), then the decoder's step;
- `_metadata`: the hybrid's takes the state label's rows out and makes the step's
  `StateBatch` of them; the attention labels' rows go on to the vision runner's (which adds
  bidirectional image blocks, none for Qwen) and the decoder's builder;
- `_backend`: the hybrid's (the attention pools only), `call_model` the vision runner's (the
  step's image rows as `embeds`), `make_request` / `prepare` / `_encode` / `positions` the
  M-RoPE runner's (the tower once per image at admission, three positions a row).

Positions come three a row (`position_streams` 3), so the C decode stack, which takes one,
never runs these steps: the modules do, text-only requests included.
"""

from __future__ import annotations

from services.gpu_worker.runners.hybrid import HybridRunner
from services.gpu_worker.runners.mrope import MropeVisionRunner


class HybridVisionRunner(HybridRunner, MropeVisionRunner):
    """See the module docstring: nothing of its own, the order of its bases is the design."""
