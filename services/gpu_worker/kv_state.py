"""What the KV manager keeps per request and label: the footprint, the pages held, the rows
committed and the prefix-cache keys. Apart from `kv_manager.py` so that its debug checks
(`kv_checks.py`) read the same types without importing the manager (no import circle).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.gpu_worker.prefix_cache import ROOT
from shared.layout import KVLabel, KVReqConfig, LabelLayout


@dataclass
class LabelState:
    """One label of one request: its footprint, the pages it holds, the rows it committed,
    and its prefix-cache keys (what the debug checks remember lives in kv_checks.Walk)."""

    label: KVLabel
    layout: LabelLayout
    footprint: int
    page_size: int
    pages: list[int] = field(default_factory=list)
    rows: int = 0  # rows committed (label positions 0..rows-1)
    first_page: int = 0  # label page index of pages[0] (pages before it were released)
    overrun_logged: bool = False
    row_keys: tuple[int, ...] = ()  # `leading_keys` of its layout, when the label is keyed
    key_pages: list[tuple[int, ...]] = field(default_factory=list)  # their full pages (`prompt_pages`)
    keyed_pages: int = 0  # leading pages matched or indexed in the prefix cache
    key_parent: int = ROOT  # entry id the next keyed page chains from
    #: the footprint without a prefix-cache hit (a hit lowers a windowed label's: `_plan_hits`)
    full_footprint: int = 0

    def __post_init__(self) -> None:
        if not self.full_footprint:
            self.full_footprint = self.footprint

    def page_for_row(self, row: int) -> int:
        return self.pages[row // self.page_size - self.first_page]


@dataclass
class RequestKV:
    request_id: str
    caps: dict[str, int]
    configs: dict[str, KVReqConfig]
    labels: dict[str, LabelState]
    #: pages reserved beyond the footprint per pool (only under max-seq-len admission)
    extra: dict[str, int] = field(default_factory=dict)
    #: prefix-cache matches planned by `can_admit`, attached by `admit`
    hits: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    hit_rows: int = 0
    #: the prompt's bidirectional blocks, row ranges [start, end) (`Span.bidirectional`, of
    #: every label's layout: a step writes the same rows of each label), which no prefill
    #: chunk and no prefix-cache hit may end inside
    blocks: tuple[tuple[int, int], ...] = ()
    #: pages held beyond its labels' own, as (pool, page): a state snapshot a prefix hit
    #: restores from, until the restore is done (`KVManager.end_restores`)
    holds: list[tuple[str, int]] = field(default_factory=list)
    #: state labels whose slot starts as a snapshot's copy: label -> the snapshot's page
    restores: dict[str, int] = field(default_factory=dict)
    #: prompt rows after which a state snapshot is due (`state_snapshot_rows`), ascending;
    #: empty where the request opens no state label or shares nothing
    snapshot_rows: tuple[int, ...] = ()

    def footprint(self, pool: str) -> int:
        return sum(s.footprint for s in self.labels.values() if s.label.pool == pool)

    def reservation(self, pool: str) -> int:
        return self.footprint(pool) + self.extra.get(pool, 0)
