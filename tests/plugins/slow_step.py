"""A test-only model whose forward sleeps: the real decoder LM (same weights, same tokens),
except that a forward over exactly `SLOW_ROWS` rows first sleeps `MSTAR_TEST_SLOW_STEP_S`
seconds (a prefill of a 77-token prompt; the warm-up's steps never have that shape), so a
test can make one step take longer than the heartbeat timeout. Loaded through
MSTAR_MODEL_PLUGINS in every service; only the gpu worker ever builds the torch model."""

from __future__ import annotations

import os
import time

from services.gpu_worker.modeling.decoder.lm import DecoderLM
from services.gpu_worker.modeling.registry import TORCH_MODELS
from shared.specs.decoder_lm import DecoderLMSpec
from shared.specs.registry import register_model

SLOW_ROWS = 77


class SlowStepSpec(DecoderLMSpec):
    """A Llama whose torch model is `SlowStepLM`."""


class SlowStepLM(DecoderLM):
    def forward(self, input_ids, positions, kv_caches, metas, sample_rows):
        if input_ids.shape[0] == SLOW_ROWS:
            time.sleep(float(os.environ.get("MSTAR_TEST_SLOW_STEP_S", "0")))  # releases the GIL, as torch ops do
        return super().forward(input_ids, positions, kv_caches, metas, sample_rows)


TORCH_MODELS[SlowStepSpec] = SlowStepLM
register_model("SlowStepLlamaForCausalLM", lambda config, **kw: SlowStepSpec(config, **kw))
