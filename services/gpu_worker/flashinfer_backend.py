"""The CUDA attention path: FlashInfer's batch prefill wrapper over the same pages.

The pages are already FlashInfer's NHD layout (`[num_pages, 2, page_size, kv_heads,
head_dim]`) and `FlashInferBuilder` makes its CSR page table (`kv_indptr`,
`kv_indices`, `kv_last_page_len`) and `qo_indptr`, so the CUDA path only plans one wrapper
per label per step (shared by every layer of that label) and `paged_attention` hands the
query to it. One prefill wrapper serves decode rows too (a query block of one row), with
FlashInfer's causal mask, which is bottom-right aligned as DESIGN.md section 5 asks, and
`window_left = W - 1` for a sliding window of W keys.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from services.gpu_worker.attention import AttnMetadata

WORKSPACE_BYTES = 128 << 20


def flashinfer_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None


class FlashInferPlanner:
    """One workspace and one wrapper per label, planned once per step."""

    def __init__(self, device: torch.device) -> None:
        import flashinfer

        self._fi = flashinfer
        self.device = device
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._wrappers: dict[str, Any] = {}  # flashinfer's wrappers (the package is untyped)

    def plan(self, label: str, meta: AttnMetadata, *, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             page_size: int, window: int | None, dtype: torch.dtype, sm_scale: float | None = None,
             softcap: float | None = None) -> AttnMetadata:
        wrapper = self._wrappers.get(label)
        if wrapper is None:
            wrapper = self._wrappers[label] = self._fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        view = meta.flashinfer
        if view is None:
            raise ValueError("FlashInfer plans from metadata its own builder made (BUILDERS['flashinfer'])")
        wrapper.plan(
            view.qo_indptr.to(self.device), view.kv_indptr.to(self.device), view.kv_indices.to(self.device),
            view.kv_last_page_len.to(self.device), num_qo_heads, num_kv_heads, head_dim, page_size,
            causal=True, window_left=-1 if window is None else window - 1, q_data_type=dtype, kv_data_type=dtype,
            sm_scale=sm_scale, logits_soft_cap=softcap,
        )
        view.wrapper = wrapper
        return meta
