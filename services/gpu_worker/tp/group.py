"""The tensor-parallel process group: torch.distributed's, nothing home-made.

One gpu worker service with `--tensor-parallel-size N` is N rank processes. Rank 0 is the
worker the conductor knows (scheduler, KV manager, sockets); it starts the other ranks of
its host as children (`start_local_ranks`), which die with it (PR_SET_PDEATHSIG), and it
watches them between steps (`dead_child`). Ranks on other hosts are started there by the
same command with `--node-rank K` and join through `--master-addr/--master-port`, as
torch.distributed's own launchers do.

Tensors go over the default group: gloo on the CPU, NCCL on CUDA. The per-step plan
(Python objects: the rows, ids and positions of a forward) goes over a gloo group on CUDA
too, as vLLM's CPU group carries its metadata broadcasts, so no plan is copied to a GPU.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("mstar.tp")

#: how long a collective may wait for its peers. Rank 0 broadcasts a heartbeat while idle
#: (`TpGroup.beat`), so this bounds only start-up skew between ranks (one loads slower)
#: and a peer that hangs without dying
TIMEOUT_S = 1800.0
PR_SET_PDEATHSIG = 1


class GroupLost(RuntimeError):
    """A collective failed: a rank died or the group fell out of lockstep. The group
    cannot step again; rank 0 fails every request it holds (503) and exits, so the
    supervisor restarts the whole group as it restarts a worker."""


@dataclass(frozen=True)
class TpPlacement:
    """Where this process sits in the group: `--tensor-parallel-size`, `--nnodes`,
    `--node-rank`, `--master-addr`, `--master-port` and its rank."""

    size: int
    rank: int = 0
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0

    @property
    def per_node(self) -> int:
        return self.size // self.nnodes

    @property
    def local_rank(self) -> int:
        return self.rank - self.node_rank * self.per_node

    @property
    def node_ranks(self) -> range:
        """The ranks this host runs."""
        return range(self.node_rank * self.per_node, (self.node_rank + 1) * self.per_node)

    def check(self) -> None:
        """ValueError naming the flag whose value cannot place the ranks."""
        if self.nnodes < 1 or self.size % self.nnodes:
            raise ValueError(f"--nnodes {self.nnodes} must divide --tensor-parallel-size {self.size}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} must be in [0, --nnodes {self.nnodes})")
        if self.nnodes > 1 and not self.master_port:
            raise ValueError("--master-port is needed when the group spans hosts (--nnodes > 1)")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Runs in a local rank before exec: SIGKILL when rank 0 (or the node's first rank) dies,
    so a group never outlives its worker."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def start_local_ranks(place: TpPlacement, argv: list[str]) -> list[subprocess.Popen]:
    """This host's other ranks: the same gpu worker command line, each told its rank and the
    group's address by environment (MSTAR_TP_RANK, MSTAR_MASTER_ADDR, MSTAR_MASTER_PORT)."""
    procs = []
    for rank in place.node_ranks:
        if rank == place.rank:
            continue
        env = dict(os.environ, MSTAR_TP_RANK=str(rank), MSTAR_MASTER_ADDR=place.master_addr,
                   MSTAR_MASTER_PORT=str(place.master_port))
        procs.append(subprocess.Popen([sys.executable, "-m", "services.gpu_worker", *argv], env=env,
                                      stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent))
        log.info("tensor-parallel rank %d of %d started (pid %d)", rank, place.size, procs[-1].pid)
    return procs


@dataclass
class TpGroup:
    """This rank's view of the group: its rank, the size, and the collectives the sharded
    layers and the lockstep loop use."""

    rank: int
    size: int
    #: the group plans travel over (gloo; the default group on the CPU)
    plan_group: Any = None
    children: list[subprocess.Popen] = field(default_factory=list)

    @classmethod
    def join(cls, place: TpPlacement, cuda: bool) -> TpGroup:
        backend = "nccl" if cuda else "gloo"
        if cuda:
            torch.cuda.set_device(place.local_rank)
        dist.init_process_group(backend, init_method=f"tcp://{place.master_addr}:{place.master_port}",
                                rank=place.rank, world_size=place.size, timeout=timedelta(seconds=TIMEOUT_S))
        plans = dist.new_group(backend="gloo") if cuda else None
        log.info("joined the tensor-parallel group as rank %d of %d (%s at %s:%d)", place.rank, place.size, backend,
                 place.master_addr, place.master_port)
        return cls(place.rank, place.size, plans)

    # -- collectives (torch.distributed's) -------------------------------------------------

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place (a row-parallel layer's partial products).
        Every rank gets the same bits (gloo's and NCCL's rings reduce each element once and
        send the result), so their residual streams stay equal."""
        dist.all_reduce(t)
        return t

    def gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0: every rank's `t` side by side along the last dimension (the vocab-parallel
        head's logits); the others get their own back (they do not sample)."""
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(t, parts, dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else t

    def min_int(self, value: int) -> int:
        """The least of every rank's `value` (pool sizes: each rank measured its own memory)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.plan_group)
        return int(t.item())

    def broadcast(self, msg: object) -> None:
        """Rank 0: send `msg` (a plan) to every rank."""
        dist.broadcast_object_list([msg], src=0, group=self.plan_group)

    def receive(self) -> object:
        """Another rank: the next message rank 0 broadcast."""
        box: list[object] = [None]
        dist.broadcast_object_list(box, src=0, group=self.plan_group)
        return box[0]

    # -- lifetime --------------------------------------------------------------------------

    def dead_child(self) -> int | None:
        """The exit code of a local rank that has died (None while all live)."""
        return next((p.returncode for p in self.children if p.poll() is not None), None)

    def close(self) -> None:
        """A clean stop (the other ranks were told to exit)."""
        if dist.is_initialized():
            dist.destroy_process_group()
        self.close_children()

    def close_children(self) -> None:
        """End this host's other ranks (a lost group: they may be blocked in a collective)."""
        for p in self.children:
            if p.poll() is None:
                p.terminate()
        for p in self.children:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
