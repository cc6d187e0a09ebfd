"""Which `ModelSpec` serves an architecture (config.json `architectures[0]`).

The built-in families are an explicit table below; extra ones (test models, a user's
family) come from the modules named in `MSTAR_MODEL_PLUGINS` (comma separated), which call
`register_model` when `load_plugins()` imports them. The spec modules never import this
one, so nothing here is imported in a circle.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable

from shared.hybrid_config import ARCHITECTURES as HYBRID_ARCHITECTURES
from shared.hybrid_config import MOE_ARCHITECTURES as HYBRID_MOE_ARCHITECTURES
from shared.model_config import ARCHITECTURES as DECODER_LM_ARCHITECTURES
from shared.specs.base import DeploymentError, ModelSpec
from shared.specs.chatterbox import ARCHITECTURE as CHATTERBOX_ARCHITECTURE
from shared.specs.chatterbox import ChatterboxSpec
from shared.specs.cosmos3 import ARCHITECTURES as COSMOS3_ARCHITECTURES
from shared.specs.cosmos3 import Cosmos3Spec
from shared.specs.csm import ARCHITECTURE as CSM_ARCHITECTURE
from shared.specs.csm import CsmSpec
from shared.specs.decoder_embed import DecoderEmbedSpec
from shared.specs.decoder_lm import DecoderLMSpec
from shared.specs.higgs import ARCHITECTURE as HIGGS_ARCHITECTURE
from shared.specs.higgs import HiggsSpec
from shared.specs.hybrid_lm import HybridLMSpec, HybridMoESpec, Qwen3NextSpec
from shared.specs.hybrid_vision_lm import ARCHITECTURES as HYBRID_VISION_ARCHITECTURES
from shared.specs.hybrid_vision_lm import Qwen35VLSpec
from shared.specs.null_lm import NULL_ARCHITECTURE, NullLMSpec
from shared.specs.orpheus import OrpheusSpec
from shared.specs.policy import PI0_ARCHITECTURES, PI05_ARCHITECTURES, Pi05Spec, PolicySpec
from shared.specs.pooling import EMBED_ARCHITECTURES, SCORE_ARCHITECTURES, EncoderSpec
from shared.specs.qwen3_omni import ARCHITECTURES as OMNI_ARCHITECTURES
from shared.specs.qwen3_omni import Qwen3OmniSpec
from shared.specs.vision_lm import (
    GEMMA3_ARCHITECTURES,
    IDEFICS3_ARCHITECTURES,
    QWEN25_VL_ARCHITECTURES,
    Gemma3VisionSpec,
    Idefics3Spec,
    Qwen25VLSpec,
)
from shared.specs.whisper import ARCHITECTURE as WHISPER_ARCHITECTURE
from shared.specs.whisper import WhisperSpec
from shared.specs.world import WORLD_ARCHITECTURES, WorldSpec
from shared.tasks import TASKS

#: factory(config, *, page_size, max_seq_len=0, dtype="float32") -> ModelSpec
SpecFactory = Callable[..., ModelSpec]

#: architecture name -> the factory of its spec (a spec class is its own factory)
MODEL_REGISTRY: dict[str, SpecFactory] = {
    **dict.fromkeys(DECODER_LM_ARCHITECTURES, DecoderLMSpec),
    **dict.fromkeys(HYBRID_ARCHITECTURES, HybridLMSpec),
    **{arch: Qwen3NextSpec if kind == "qwen3_next" else HybridMoESpec
       for arch, kind in HYBRID_MOE_ARCHITECTURES.items() if arch not in HYBRID_VISION_ARCHITECTURES},
    **dict.fromkeys(HYBRID_VISION_ARCHITECTURES, Qwen35VLSpec),
    NULL_ARCHITECTURE: NullLMSpec,
    WHISPER_ARCHITECTURE: WhisperSpec,
    **dict.fromkeys(EMBED_ARCHITECTURES + SCORE_ARCHITECTURES, EncoderSpec),
    **dict.fromkeys(IDEFICS3_ARCHITECTURES, Idefics3Spec),
    **dict.fromkeys(QWEN25_VL_ARCHITECTURES, Qwen25VLSpec),
    **dict.fromkeys(GEMMA3_ARCHITECTURES, Gemma3VisionSpec),
    CSM_ARCHITECTURE: CsmSpec,
    **dict.fromkeys(PI0_ARCHITECTURES, PolicySpec),
    **dict.fromkeys(PI05_ARCHITECTURES, Pi05Spec),
    **dict.fromkeys(WORLD_ARCHITECTURES, WorldSpec),
    **dict.fromkeys(OMNI_ARCHITECTURES, Qwen3OmniSpec),
    HIGGS_ARCHITECTURE: HiggsSpec,
    CHATTERBOX_ARCHITECTURE: ChatterboxSpec,
    **dict.fromkeys(COSMOS3_ARCHITECTURES, Cosmos3Spec),
}


def register_model(architecture: str, factory: SpecFactory) -> None:
    """Serve `architecture` with the spec `factory(config, page_size=, max_seq_len=, dtype=)` builds."""
    MODEL_REGISTRY[architecture] = factory


@functools.cache
def load_plugins() -> None:
    """Import each module `MSTAR_MODEL_PLUGINS` names (once per process), so its
    `register_model` calls add its architectures after the built-in ones."""
    for mod in filter(None, (m.strip() for m in os.environ.get("MSTAR_MODEL_PLUGINS", "").split(","))):
        importlib.import_module(mod)


#: the embedding variant of a generating family (`--task embed`, a sentence-transformers folder)
EMBED_VARIANTS: dict[SpecFactory, SpecFactory] = {DecoderLMSpec: DecoderEmbedSpec}
#: the text-to-speech variant (`--task speech`, a folder with a SNAC codec at `snac/`)
SPEECH_VARIANTS: dict[SpecFactory, SpecFactory] = {DecoderLMSpec: OrpheusSpec}


def spec_factory(architecture: str, task: str = "auto", pooled_folder: bool = False,
                 speech_folder: bool = False) -> SpecFactory:
    """The factory of `architecture`'s spec for `task`: a family's embedding variant where
    embeddings are asked (or the folder is a sentence-transformers embedding model); a
    DeploymentError naming the architecture when none serves it."""
    if task not in TASKS:
        raise DeploymentError(f"task {task!r} is not one of {TASKS}")
    factory = MODEL_REGISTRY.get(architecture)
    if factory is None:
        raise DeploymentError(f"architecture {architecture!r} is not supported; supported: {sorted(MODEL_REGISTRY)}")
    if task == "embed" or (task == "auto" and pooled_folder):
        factory = EMBED_VARIANTS.get(factory, factory)
    elif task == "speech" or (task == "auto" and speech_folder):
        factory = SPEECH_VARIANTS.get(factory, factory)
    return factory

