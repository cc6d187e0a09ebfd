"""What the runners read of a spec is declared (issue 28): every `self.spec.<name>` in
runners/base.py and runners/encdec.py is a member of its runner's protocol in shared/specs/base.py,
every built-in family has those members, and a spec that lacks one is refused by name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from services.gpu_worker.runners.base import ModelRunner
from services.gpu_worker.runners.encdec import EncoderDecoderRunner
from shared.specs.base import (
    DecoderRunnerSpec,
    DeploymentError,
    EncoderDecoderRunnerSpec,
    protocol_members,
    refuse_runner_gaps,
)
from shared.specs.decoder_lm import DecoderLMSpec
from shared.specs.null_lm import NullLMSpec, null_config
from tests.whisper_checkpoints import make_whisper_checkpoint

WORKER = Path(__file__).resolve().parents[2] / "services" / "gpu_worker"
CONFIG = {"num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": 16,
          "max_position_embeddings": 1024}


def _spec_reads(path: Path) -> set[str]:
    return {n.attr for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == "spec"
            and isinstance(n.value.value, ast.Name) and n.value.value.id == "self"}


@pytest.mark.parametrize("module, proto", [("runners/base.py", DecoderRunnerSpec),
                                           ("runners/encdec.py", EncoderDecoderRunnerSpec)])
def test_every_attribute_a_runner_reads_is_declared(module, proto):
    reads = _spec_reads(WORKER / module)
    assert reads, module
    assert not reads - set(protocol_members(proto)), reads - set(protocol_members(proto))


def test_the_runners_name_their_protocols():
    assert ModelRunner.SPEC is DecoderRunnerSpec and EncoderDecoderRunner.SPEC is EncoderDecoderRunnerSpec


def test_built_in_families_have_what_their_runner_reads(tmp_path):
    for spec in (DecoderLMSpec(CONFIG, page_size=16), NullLMSpec(null_config(), page_size=16)):
        assert isinstance(spec, DecoderRunnerSpec)
        refuse_runner_gaps(spec, DecoderRunnerSpec)
    from shared.model_source import ModelSource

    whisper = ModelSource(str(make_whisper_checkpoint(tmp_path / "whisper"))).spec(16)
    assert isinstance(whisper, EncoderDecoderRunnerSpec)
    refuse_runner_gaps(whisper, EncoderDecoderRunnerSpec)


def test_a_spec_missing_a_member_is_refused_by_name():
    class Bare:
        engine = "decoder"
        kv_labels = ()
        step_loops = ("decode_loop",)

        def label(self, name):
            raise KeyError(name)

    with pytest.raises(DeploymentError) as info:
        refuse_runner_gaps(Bare(), DecoderRunnerSpec)
    assert "reads ['layer_labels', 'config'] of its spec" in str(info.value)
