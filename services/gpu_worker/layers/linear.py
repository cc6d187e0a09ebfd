"""Linear layers for the CPU path: oneDNN GEMM on weights reordered once at load.

`F.linear` on the CPU hands MKL a transposed weight every call; for the row counts a
serving step has (a few to a few dozen decode rows) that is slower than oneDNN's GEMM on
a weight already in its blocked layout, for the LM head and for a whole step alike. At
one or two rows the plain call is the faster one (a GEMV), so both are kept where the
plain weight is kept anyway (a tied LM head shares the embedding) or where the layers
are small enough that the copy is worth it (`keep_plain`).

oneDNN builds (JIT-compiles) and caches one kernel per distinct row count, each taking
memory, and its cache evicts by LRU: fed every row count a server sees, a worker grew
with each new count and kept growing once the cache cycled (evicted kernels are built
again). So row counts are rounded up to a bounded set of buckets (`row_bucket`, zero
rows padded and sliced off) and `warm_packed` builds every bucket's kernel at start-up:
the worker's memory at ready is its memory under any load.

Where the C GEMM kernel is built (kernels/gemm.c: AVX-512, one compute thread) it takes
the place of oneDNN: `KernelLinear` / `KernelHead` keep only the kernel's packed weight,
which is faster at decode row counts, as fast at prefill ones, needs no per-row-count
kernel (nothing to warm, nothing to grow) and gives every row the same result whatever
batch it is in. With more than one compute thread oneDNN's threaded GEMM is kept.

On CUDA, or where torch has no oneDNN and no kernel is built, `pack_linears` does nothing
and every layer stays a plain `nn.Linear`.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from services.gpu_worker import cpu_kernels
from shared.pages import ceil_div

#: at most this many rows go through the plain weight (when it is kept)
PLAIN_MAX_ROWS = 2
#: the row count oneDNN blocks the weight for (a c16 decode step); any count works
PACK_HINT_ROWS = 16


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_HINT_ROWS)


def row_bucket(rows: int) -> int:
    """The row count a GEMM of `rows` rows runs at: exact up to 16 (small decode batches,
    where a padded row costs the most), then multiples of 8 to 64, of 32 to 512, of 128
    beyond. At most 16 + 6 + 14 + rows/128 distinct kernels per weight shape."""
    if rows <= 16:
        return rows
    step = 8 if rows <= 64 else 32 if rows <= 512 else 128
    return ceil_div(rows, step) * step


def row_buckets(max_rows: int) -> list[int]:
    """Every bucket a call of 1..`max_rows` rows can land in."""
    return sorted({row_bucket(m) for m in range(1, max_rows + 1)})


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    rows = x2.shape[0]
    padded = row_bucket(rows)
    if padded != rows:
        x2 = F.pad(x2, (0, 0, 0, padded - rows))
    out = torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")
    if padded != rows:
        out = out[:rows]
    return out.view(*shape[:-1], out.shape[-1])


class PackedLinear(nn.Module):
    """An `nn.Linear` whose weight lives in oneDNN's blocked layout; the plain weight is
    kept only if `keep_plain` (for one- or two-row calls)."""

    def __init__(self, linear: nn.Linear, keep_plain: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = pack_weight(linear.weight)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.plain = linear.weight.detach() if keep_plain else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plain is not None and x.numel() <= PLAIN_MAX_ROWS * self.in_features:
            return F.linear(x, self.plain, self.bias)
        return packed_linear(x, self.packed, self.bias)


class PackedHead:
    """The LM head's weight in oneDNN's layout beside the plain one (the embedding of a
    tied model, which the lookup needs anyway)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.plain = weight
        self.packed = pack_weight(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= PLAIN_MAX_ROWS:
            return F.linear(x, self.plain)
        return packed_linear(x, self.packed, None)


def _kernels() -> ctypes.CDLL:
    """The built C kernels: only asked for once `kernel_available()` (or `gemm_panel()`) said so."""
    lib = cpu_kernels.library()
    assert lib is not None, "the C kernels are not built"
    return lib


def kernel_available() -> bool:
    """The C GEMM is used: built for this CPU, and one compute thread (it is single-threaded;
    with more, oneDNN's threaded GEMM is the faster)."""
    return torch.get_num_threads() == 1 and cpu_kernels.gemm_panel() > 0


def kernel_packed_size(n: int, k: int) -> int:
    """The floats `kernel_pack` makes of an [n, k] weight."""
    nr = cpu_kernels.gemm_panel()
    return ceil_div(n, nr) * nr * k


def kernel_pack(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`weight` [N, K] in the kernel's panels: [ceil(N / panel) * panel * K] floats, into
    `out` where given (a contiguous float32 tensor of that many elements: a row of a stack
    of packed weights, with no copy of each on the way)."""
    w = weight.detach().contiguous()
    n, k = w.shape
    size = kernel_packed_size(n, k)
    packed = torch.empty(size) if out is None else out
    if packed.numel() != size or packed.dtype != torch.float32 or not packed.is_contiguous():
        raise ValueError(f"kernel_pack needs {size} contiguous floats for a [{n}, {k}] weight")
    _kernels().mstar_gemm_pack(w.data_ptr(), n, k, packed.data_ptr())
    return packed


def kernel_unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    w = torch.empty(n, k)
    _kernels().mstar_gemm_unpack(packed.data_ptr(), n, k, w.data_ptr())
    return w


def _kernel_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels read it: float32 CPU rows [M, K] with unit stride along K."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype != torch.float32 or x2.device.type != "cpu":  # the kernel reads float32 rows
        raise TypeError(f"the CPU GEMM kernel takes float32 CPU input, got {x2.dtype} on {x2.device}")
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def kernel_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    x2 = _kernel_rows(x)
    out = torch.empty(x2.shape[0], out_features)
    if x2.shape[0]:
        _kernels().mstar_gemm(x2.data_ptr(), x2.shape[0], x2.shape[1], x2.stride(0), packed.data_ptr(),
                              out_features, None if bias is None else bias.data_ptr(), out.data_ptr(),
                              out_features)
    return out.view(*x.shape[:-1], out_features)


class KernelLinear(nn.Module):
    """An `nn.Linear` through the C GEMM; only the packed weight is kept (`weight`
    unpacks a copy, for inspection)."""

    #: what a decode step streams (huge_pages.place puts them on 2 MB pages)
    hot_tensors = ("packed", "bias")

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = kernel_pack(linear.weight)
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()

    @property
    def weight(self) -> torch.Tensor:
        return kernel_unpack(self.packed, self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernel_linear(x, self.packed, self.out_features, self.bias)


class KernelGateUpSilu(nn.Module):
    """The MLP's fused gate/up `nn.Linear` (weight [gate; up], 2 x inter rows) and the
    silu(gate) * up after it, as one C call: the kernel applies silu * up to each tile as
    it leaves the registers, so the 2 x inter wide intermediate (in every layer, for every
    row of a prefill chunk) is never written and read back. Same bits as
    `KernelLinear` followed by `fused.silu_mul`. No bias (no checkpoint here has one)."""

    in_features: int
    inter: int
    packed: torch.Tensor
    #: what a decode step streams (huge_pages.place puts it on 2 MB pages)
    hot_tensors = ("packed",)

    def __init__(self, gate_up: nn.Linear) -> None:
        super().__init__()
        if gate_up.bias is not None or gate_up.out_features % 2:
            raise ValueError("KernelGateUpSilu takes a bias-free [gate; up] weight")
        self.in_features, self.inter = gate_up.in_features, gate_up.out_features // 2
        self.packed = kernel_pack_gate_up(gate_up.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernel_gate_up_silu(x, self.packed, self.inter)


def kernel_gate_up_size(inter: int, k: int) -> int:
    """The floats `kernel_pack_gate_up` makes of a [2 x inter, k] weight."""
    half = cpu_kernels.gemm_panel() // 2
    return kernel_packed_size(ceil_div(inter, half) * 2 * half, k)


def kernel_pack_gate_up(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """A [gate; up] weight [2 x inter, K] in `mstar_gemm_silu`'s panels (each panel half
    gate rows, half the same up rows), so silu(gate) * up is taken as the tile leaves the
    registers; into `out` where given (`kernel_pack`). Also each expert's weight of a
    mixture of experts (layers/moe.py)."""
    inter = weight.shape[0] // 2
    half = cpu_kernels.gemm_panel() // 2
    panels = ceil_div(inter, half)
    w = weight.detach()
    gate, up = (F.pad(part, (0, 0, 0, panels * half - inter)).view(panels, half, -1)
                for part in (w[:inter], w[inter:]))
    # panel p: gate rows [p*half, (p+1)*half) then the same up rows
    return kernel_pack(torch.cat((gate, up), dim=1).reshape(panels * 2 * half, -1), out)


def kernel_gate_up_silu(x: torch.Tensor, packed: torch.Tensor, inter: int) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) [.., inter] on a `kernel_pack_gate_up` weight; each
    row's bits are the same whatever rows share the call."""
    x2 = _kernel_rows(x)
    out = torch.empty(x2.shape[0], inter)
    if x2.shape[0]:
        _kernels().mstar_gemm_silu(x2.data_ptr(), x2.shape[0], x2.shape[1], x2.stride(0),
                                   packed.data_ptr(), inter, out.data_ptr(), inter)
    return out.view(*x.shape[:-1], inter)


class KernelHead:
    """The LM head through the C GEMM at every row count (a GEMV at one row is as fast as
    MKL's); only the packed weight is kept here (a tied model's embedding keeps its own)."""

    #: what a decode step streams (huge_pages.place puts it on 2 MB pages)
    hot_tensors = ("packed",)

    def __init__(self, weight: torch.Tensor) -> None:
        self.vocab = weight.shape[0]
        self.packed = kernel_pack(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return kernel_linear(x, self.packed, self.vocab, None)


def make_head(weight: torch.Tensor) -> KernelHead | PackedHead | None:
    """The faster CPU LM head for `weight` (float32 on the CPU), or None (plain F.linear)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    if kernel_available():
        return KernelHead(weight)
    return PackedHead(weight) if onednn_available() else None


def pack_linears(module: nn.Module, keep_plain: bool = True) -> int:
    """Swap every CPU float32 `nn.Linear` under `module` for a `KernelLinear` (the C GEMM,
    where built) or a `PackedLinear` (oneDNN); returns how many were swapped (0 where
    neither is there or the weights are not on the CPU)."""
    kernel = kernel_available()
    if not kernel and not onednn_available():
        return 0
    swapped = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and child.weight.device.type == "cpu" and child.weight.dtype == torch.float32:
            setattr(module, name, KernelLinear(child) if kernel else PackedLinear(child, keep_plain))
            swapped += 1
        else:
            swapped += pack_linears(child, keep_plain)
    return swapped


def warm_packed(module: nn.Module, max_rows: int, head: KernelHead | PackedHead | nn.Module | None = None,
                max_head_rows: int = 0) -> int:
    """Build oneDNN's kernel for every row bucket of every packed weight shape under
    `module` (and of `head` up to `max_head_rows`) now, at start-up, rather than under load;
    returns how many GEMMs it ran. Kernels are cached by shape, so one layer per shape does.
    (`KernelLinear`s and a `KernelHead` need nothing built.)"""
    shapes: dict[tuple[int, int, bool], PackedLinear] = {}
    for m in module.modules():
        if isinstance(m, PackedLinear):
            shapes.setdefault((m.in_features, m.out_features, m.plain is not None), m)
    # (packed weight, bias, in features, most rows, fewest rows that reach oneDNN)
    todo: list[tuple[torch.Tensor, torch.Tensor | None, int, int, int]] = [
        (layer.packed, layer.bias, layer.in_features, max_rows, PLAIN_MAX_ROWS + 1 if layer.plain is not None else 1)
        for layer in shapes.values()]
    if isinstance(head, PackedHead):
        todo.append((head.packed, None, head.plain.shape[1], max_head_rows, PLAIN_MAX_ROWS + 1))
    runs = 0
    with torch.inference_mode():
        for packed, bias, in_features, most, fewest in todo:
            for rows in row_buckets(most):
                if rows >= fewest:
                    packed_linear(torch.zeros(rows, in_features), packed, bias)
                    runs += 1
    return runs
