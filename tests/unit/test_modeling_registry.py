"""The spec -> torch model table (services/gpu_worker/modeling/registry.py) and the
defaults of the two contracts: `ModelBase` for torch models, `ModelSpec` for specs."""

from __future__ import annotations

import pytest
import torch

from services.gpu_worker.modeling.base import ENGINE_MODELS, DecoderModel, ModelBase
from services.gpu_worker.modeling.decoder.lm import DecoderLM
from services.gpu_worker.modeling.decoder.null_lm import NullLM
from services.gpu_worker.modeling.registry import TORCH_MODELS, torch_model_for
from services.gpu_worker.modeling.speech.whisper import WhisperModel
from shared.specs.base import DeploymentError, ModelSpec
from shared.specs.decoder_lm import DecoderLMSpec
from shared.specs.null_lm import NullLMSpec
from shared.specs.registry import MODEL_REGISTRY
from shared.specs.whisper import WhisperSpec
from tests.plugins import models as plugins


def test_every_entry_runs_on_its_specs_engine():
    for spec_cls, model_cls in TORCH_MODELS.items():
        assert issubclass(model_cls, ENGINE_MODELS[spec_cls.engine]), (spec_cls, model_cls)
        assert torch_model_for(spec_cls) is model_cls


def test_every_built_in_architecture_has_a_torch_model():
    for arch, factory in MODEL_REGISTRY.items():
        if isinstance(factory, type):  # plugins may register plain functions
            assert issubclass(torch_model_for(factory), ModelBase), arch
    assert torch_model_for(MODEL_REGISTRY["LlamaForCausalLM"]) is DecoderLM
    assert torch_model_for(MODEL_REGISTRY["NullLM"]) is NullLM
    assert torch_model_for(MODEL_REGISTRY["WhisperForConditionalGeneration"]) is WhisperModel


def test_a_spec_subclass_gets_its_nearest_listed_ancestors_model():
    for cls in (plugins.UnderstatedGrowthSpec, plugins.GhostLabelSpec, plugins.OrphanPoolSpec, plugins.RowsWindowSpec):
        assert torch_model_for(cls) is DecoderLM
    assert torch_model_for(NullLMSpec) is NullLM  # its own entry wins over DecoderLMSpec's

    class Variant(WhisperSpec):
        pass

    assert torch_model_for(Variant) is WhisperModel


def test_an_unlisted_spec_or_a_mismatched_engine_is_refused():
    class Unlisted(ModelSpec):
        pass

    with pytest.raises(DeploymentError, match="no torch model runs Unlisted"):
        torch_model_for(Unlisted)

    class EncDecDecoder(DecoderLMSpec):
        engine = "encoder_decoder"

    with pytest.raises(DeploymentError, match="DecoderLM is not a EncoderDecoderModel"):
        torch_model_for(EncDecDecoder)

    class Unknown(DecoderLMSpec):
        engine = "teleport"

    with pytest.raises(DeploymentError, match="engine is 'teleport'"):
        torch_model_for(Unknown)


def test_model_base_defaults():
    class Tiny(DecoderModel):
        def __init__(self, config) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(2))

        def load_weights(self, state) -> None:
            self.load_state_dict(state)

        def forward(self, input_ids, positions, kv_caches, metas, sample_rows):
            return self.w[None].expand(len(sample_rows), 2)

    m = Tiny({})
    assert Tiny.assigns_weights is False and DecoderLM.assigns_weights is True
    assert m.prepare() is None and m.reset_buffers() is None and m.warm_gemms(64, 8) == 0

    class NoLoader(DecoderModel):
        def forward(self, *args):
            return None

    with pytest.raises(TypeError, match="load_weights"):
        NoLoader()


def test_model_spec_defaults(tmp_path):
    spec = DecoderLMSpec({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32,
                          "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                          "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64},
                         page_size=4)
    assert spec.load_folder(tmp_path) is spec
    assert spec.suppress_tokens == () and spec.begin_suppress_tokens == ()
    assert spec.engine == "decoder" and spec.decode_loop == "decode_loop" and not spec.takes_audio
