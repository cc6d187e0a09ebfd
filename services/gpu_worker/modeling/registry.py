"""The explicit table from a model's spec class (shared/specs/) to its torch class (here).

A spec class maps to the torch model that runs it; a subclass of a listed spec (a plugin's
variant of `DecoderLMSpec`, say) gets its nearest listed ancestor's model, found along its
MRO. A spec with no entry is refused by name, and a model whose base does not match the
step loop its spec names (`ModelSpec.engine`) is refused too, before any weight is read.
"""

from __future__ import annotations

from services.gpu_worker.modeling.base import ENGINE_MODELS, ModelBase
from services.gpu_worker.modeling.decoder.embed import DecoderEmbedder
from services.gpu_worker.modeling.decoder.lm import DecoderLM
from services.gpu_worker.modeling.decoder.null_lm import NullLM
from services.gpu_worker.modeling.diffusion.cosmos3 import Cosmos3
from services.gpu_worker.modeling.encoder.bert import BertModel
from services.gpu_worker.modeling.hybrid.qwen3_5 import Qwen35LM
from services.gpu_worker.modeling.hybrid.qwen3_5_moe import Qwen35MoeLM
from services.gpu_worker.modeling.hybrid.qwen3_5_vision import Qwen35VLModel
from services.gpu_worker.modeling.hybrid.qwen3_next import Qwen3NextLM
from services.gpu_worker.modeling.policy.pi0 import Pi0Policy, Pi05Policy
from services.gpu_worker.modeling.speech.chatterbox import T3Model
from services.gpu_worker.modeling.speech.csm import CsmModel
from services.gpu_worker.modeling.speech.higgs import HiggsModel
from services.gpu_worker.modeling.speech.whisper import WhisperModel
from services.gpu_worker.modeling.vision.gemma3 import Gemma3VisionLM
from services.gpu_worker.modeling.vision.idefics3 import Idefics3LM
from services.gpu_worker.modeling.vision.qwen2_5_vl import Qwen25VLModel
from services.gpu_worker.modeling.vision.qwen3_omni import Qwen3OmniThinker
from services.gpu_worker.modeling.world.vjepa2_ac import VJepa2ACWorld
from shared.specs.base import DeploymentError, ModelSpec
from shared.specs.chatterbox import ChatterboxSpec
from shared.specs.cosmos3 import Cosmos3Spec
from shared.specs.csm import CsmSpec
from shared.specs.decoder_embed import DecoderEmbedSpec
from shared.specs.decoder_lm import DecoderLMSpec
from shared.specs.higgs import HiggsSpec
from shared.specs.hybrid_lm import HybridLMSpec, HybridMoESpec, Qwen3NextSpec
from shared.specs.hybrid_vision_lm import Qwen35VLSpec
from shared.specs.null_lm import NullLMSpec
from shared.specs.policy import Pi05Spec, PolicySpec
from shared.specs.pooling import EncoderSpec
from shared.specs.qwen3_omni import Qwen3OmniSpec
from shared.specs.vision_lm import Gemma3VisionSpec, Idefics3Spec, Qwen25VLSpec
from shared.specs.whisper import WhisperSpec
from shared.specs.world import WorldSpec

#: spec class -> torch model class
TORCH_MODELS: dict[type[ModelSpec], type[ModelBase]] = {
    DecoderLMSpec: DecoderLM,
    HybridLMSpec: Qwen35LM,
    HybridMoESpec: Qwen35MoeLM,
    Qwen3NextSpec: Qwen3NextLM,
    Qwen35VLSpec: Qwen35VLModel,
    NullLMSpec: NullLM,
    WhisperSpec: WhisperModel,
    EncoderSpec: BertModel,
    DecoderEmbedSpec: DecoderEmbedder,
    Idefics3Spec: Idefics3LM,
    Qwen25VLSpec: Qwen25VLModel,
    Gemma3VisionSpec: Gemma3VisionLM,
    CsmSpec: CsmModel,
    PolicySpec: Pi0Policy,
    Pi05Spec: Pi05Policy,
    WorldSpec: VJepa2ACWorld,
    Qwen3OmniSpec: Qwen3OmniThinker,
    HiggsSpec: HiggsModel,
    ChatterboxSpec: T3Model,
    Cosmos3Spec: Cosmos3,
}


def torch_model_for(spec: ModelSpec | type[ModelSpec]) -> type[ModelBase]:
    """The torch class that runs `spec` (an instance or a class): the entry of its class or
    of its nearest ancestor in `TORCH_MODELS`."""
    spec_cls = spec if isinstance(spec, type) else type(spec)
    for cls in spec_cls.__mro__:
        model_cls = TORCH_MODELS.get(cls)
        if model_cls is not None:
            break
    else:
        raise DeploymentError(f"no torch model runs {spec_cls.__name__}: neither it nor a base class is in "
                              f"services.gpu_worker.modeling.registry.TORCH_MODELS "
                              f"({sorted(c.__name__ for c in TORCH_MODELS)})")
    want = ENGINE_MODELS.get(spec_cls.engine)
    if want is None:
        raise DeploymentError(f"{spec_cls.__name__}.engine is {spec_cls.engine!r}; "
                              f"the gpu worker has {sorted(ENGINE_MODELS)}")
    if not issubclass(model_cls, want):
        raise DeploymentError(f"{spec_cls.__name__} runs on the {spec_cls.engine!r} engine, but its torch model "
                              f"{model_cls.__name__} is not a {want.__name__}")
    return model_cls
