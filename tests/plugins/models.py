"""Test-only model families, loaded by every service through MSTAR_MODEL_PLUGINS.

Each is the real decoder LM (same torch implementation, same weights) with one thing
about its declarations changed, so the tests can drive the contract's failure paths
through real processes."""

from __future__ import annotations

import msgspec

from shared.layout import LabelLayout, PagedKVConfig, ProcessPromptOutput
from shared.specs.base import PromptRequest
from shared.specs.decoder_lm import DecoderLMSpec
from shared.specs.registry import register_model


class UnderstatedGrowthSpec(DecoderLMSpec):
    """Declares no decode growth for prompts of odd length (a model bug): those requests
    take pages past their footprint. Even-length prompts are declared correctly."""

    def process_prompt(self, request: PromptRequest) -> ProcessPromptOutput:
        out = super().process_prompt(request)
        if len(request.token_ids) % 2:
            out.kv_layout = {name: msgspec.structs.replace(lay, growth={self.decode_loop: 0})
                             for name, lay in out.kv_layout.items()}
        return out


class GhostLabelSpec(DecoderLMSpec):
    """Returns a layout for a label it never declared, for every prompt."""

    def process_prompt(self, request: PromptRequest) -> ProcessPromptOutput:
        out = super().process_prompt(request)
        out.kv_layout["ghost"] = LabelLayout(growth={self.decode_loop: 1})
        return out


class OddGhostLabelSpec(GhostLabelSpec):
    """The ghost label only for odd-length prompts: it passes the worker's warm-up (16
    tokens) and fails at intake."""

    def process_prompt(self, request: PromptRequest) -> ProcessPromptOutput:
        if len(request.token_ids) % 2:
            return super().process_prompt(request)
        return DecoderLMSpec.process_prompt(self, request)


class TwoLoopSpec(DecoderLMSpec):
    """A decoder whose decode step also iterates a second loop, "budget_loop" (at most 10
    iterations), with caps below max_tokens - 1 for both: the decode loop's cap binds for
    large max_tokens, the budget's for small ones, and a max_tokens whose budget needs
    more than 10 iterations is refused."""

    budget_loop = "budget_loop"

    @property
    def step_loops(self) -> tuple[str, ...]:
        return (self.decode_loop, self.budget_loop)

    def graph_loops(self) -> dict[str, int]:
        return {**super().graph_loops(), self.budget_loop: 10}

    def get_loop_caps(self, max_tokens: int, prompt_len: int | None = None) -> dict[str, int]:
        return {self.decode_loop: max(1, (max_tokens - 1) // 2), self.budget_loop: max(1, max_tokens - 5)}


class OrphanPoolSpec(DecoderLMSpec):
    """Declares a paged pool that no label lives in."""

    def paged_pools(self, num_pages: int) -> dict[str, PagedKVConfig]:
        pools = super().paged_pools(num_pages)
        pools["orphan"] = PagedKVConfig("orphan", 1, 1, 8, self.dtype, self.page_size, num_pages, self.max_seq_len)
        return pools


class RowsWindowSpec(DecoderLMSpec):
    """Qwen2 with sliding-window layers whose window label declares its prompt as a
    `rows` span (never keyed): two labels, one keyed ids, one rows and windowed."""

    window_span_kind = "rows"


for arch, cls in {
    "UnderstatedGrowthLlamaForCausalLM": UnderstatedGrowthSpec,
    "GhostLabelLlamaForCausalLM": GhostLabelSpec,
    "OddGhostLabelLlamaForCausalLM": OddGhostLabelSpec,
    "TwoLoopLlamaForCausalLM": TwoLoopSpec,
    "OrphanPoolLlamaForCausalLM": OrphanPoolSpec,
    "RowsWindowQwen2ForCausalLM": RowsWindowSpec,
}.items():
    register_model(arch, lambda config, _cls=cls, **kw: _cls(config, **kw))
