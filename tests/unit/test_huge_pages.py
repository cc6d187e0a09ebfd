"""The decode step's hot memory on 2 MB pages (services/gpu_worker/huge_pages.py): mappings
start on a 2 MB boundary and are advised `MADV_HUGEPAGE` (the kernel's `hg` flag on the
mapping), the weights move into one arena with their bytes unchanged, a quantized model's
logits are bitwise the same with huge pages on and off, and `MSTAR_HUGE_PAGES=0` turns
it all off."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from bench.perplexity import load
from services.gpu_worker import huge_pages
from services.gpu_worker.kv_memory import zeroed_tensor
from services.gpu_worker.layers import quant
from tests.checkpoints import make_checkpoint
from tests.gguf_files import write_gguf

SMAPS = Path("/proc/self/smaps")
needs_linux = pytest.mark.skipif(not SMAPS.exists() or not hasattr(mmap, "MADV_HUGEPAGE"),
                                 reason="no /proc/self/smaps or MADV_HUGEPAGE")


def vm_flags(addr: int) -> list[str]:
    """The kernel's VmFlags of the mapping holding `addr`."""
    inside = False
    for line in SMAPS.read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@needs_linux
def test_a_pool_starts_on_a_2mb_boundary_advised_for_huge_pages(monkeypatch):
    monkeypatch.delenv("MSTAR_HUGE_PAGES", raising=False)
    t = zeroed_tensor((300, 2, 16, 3, 64), torch.bfloat16, torch.device("cpu"))  # 11.8 MB
    assert t.data_ptr() % huge_pages.HUGE == 0
    assert "hg" in vm_flags(t.data_ptr())
    assert t.shape == (300, 2, 16, 3, 64) and not t.any()
    t[-1] = 1.0  # the last byte is inside the mapping
    assert t.float().sum() == 2 * 16 * 3 * 64


@needs_linux
def test_off_is_a_plain_mapping(monkeypatch):
    monkeypatch.setenv("MSTAR_HUGE_PAGES", "0")
    t = zeroed_tensor((1 << 20,), torch.float32, torch.device("cpu"))
    assert "hg" not in vm_flags(t.data_ptr())
    assert huge_pages.place([(type("Owner", (), {"w": torch.ones(3)})(), "w")]) == 0


def test_small_mappings_stay_plain():
    assert huge_pages.anonymous(4096).numel() == 4096


@needs_linux
def test_place_moves_every_tensor_into_one_aligned_arena(monkeypatch):
    monkeypatch.delenv("MSTAR_HUGE_PAGES", raising=False)

    class Owner:
        hot_tensors = ("w", "d", "m")

        def __init__(self, n: int) -> None:
            self.w = torch.randint(0, 255, (n, 3), dtype=torch.uint8)
            self.d = torch.randn(n, 7)
            self.m = None  # an absent optional tensor is skipped

    owners = [Owner(n) for n in (1000, 100_000, 7)]  # 3.4 MB
    before = [(o.w.clone(), o.d.clone()) for o in owners]
    slots = [(o, name) for o in owners for name in Owner.hot_tensors]
    placed = huge_pages.place(slots)
    ptrs = [t.data_ptr() for o in owners for t in (o.w, o.d)]
    assert all(p % huge_pages.ALIGN == 0 for p in ptrs)
    assert max(ptrs) - min(ptrs) < placed
    assert "hg" in vm_flags(min(ptrs))
    for o, (w, d) in zip(owners, before):
        assert torch.equal(o.w, w) and torch.equal(o.d, d) and o.m is None


@pytest.mark.skipif(not quant.available(), reason="no quantized GEMM kernel")
def test_a_quantized_model_decodes_bitwise_the_same_on_huge_pages(monkeypatch, tmp_path):
    """A prompt and decode steps through the C stack, weights and pages placed or not."""
    from tests.unit.test_cpu_stack import QTYPES, _forward, _prefilled

    # wide enough that the layers' weights pass the 2 MB a huge page needs (~5 MB)
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama", hidden_size=256, intermediate_size=4096)
    path = write_gguf(ckpt, tmp_path / "model.gguf", "llama", "gpt2", qtypes=QTYPES)
    runs = []
    for on in ("1", "0"):
        monkeypatch.setenv("MSTAR_HUGE_PAGES", on)
        model, spec, _ = load(str(path), "auto", "float32")
        hot = [getattr(o, n) for o, n in huge_pages.hot_slots(model, model.head)]
        hot = [t for t in hot if t is not None]
        assert len(hot) >= 4 * len(model.model.layers)  # q/k/v, o, gate/up, down at least
        if SMAPS.exists() and on == "1":
            # (not the converse: numpy advises its own large arrays, and the heap they were
            # carved from keeps the flag, so memory that was never placed may carry it too)
            wrong = [(tuple(t.shape), t.dtype) for t in hot if "hg" not in vm_flags(t.data_ptr())]
            assert not wrong
        caches = _prefilled(model, spec, [21])
        steps = [_forward(model, caches, [5 + i], [21 + i], [(list(range(8)), 0, 21 + i, 1, True)], stack=True)
                 for i in range(4)]
        runs.append((torch.stack(steps), caches))
    (a, pages_a), (b, pages_b) = runs
    assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(pages_a, pages_b))
