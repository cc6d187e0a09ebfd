"""A gpu worker process's part in a tensor-parallel group (`python -m services.gpu_worker`
with `--tensor-parallel-size N` > 1): which rank it is, the local ranks it starts, the
group it joins, and, for a rank other than 0, the loop that follows rank 0's plans."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os

from shared.config import Deployment, kv_dtype
from shared.model_source import ModelSource
from shared.specs.base import DeploymentError

log = logging.getLogger("mstar.tp")


def refuse_unservable(d: Deployment) -> None:
    """A DeploymentError, before any rank starts, where the model cannot be sharded over
    `d.tensor_parallel_size` ranks (naming the config field and its value)."""
    from services.gpu_worker.tp.shard import refuse_unsplittable

    spec = ModelSource(d.model).spec(d.page_size, d.max_seq_len, kv_dtype(d), d.task)
    if spec.engine != "decoder":
        raise DeploymentError(f"--tensor-parallel-size {d.tensor_parallel_size}: tensor parallelism shards decoder "
                              f"LMs; this model's engine is {spec.engine!r}, which it does not split")
    refuse_unsplittable(spec.config, d.tensor_parallel_size)  # type: ignore[attr-defined]  # a DecoderLMSpec's


def placement(args: argparse.Namespace, d: Deployment):
    """This process's place in the group: rank 0 where started by the user or the launcher
    on node 0 (the first rank of its node elsewhere); a local rank rank 0 started is told
    its rank by MSTAR_TP_RANK. A one-host group with no --master-port gets a free one."""
    from services.gpu_worker.tp.group import TpPlacement, free_port

    per = d.tensor_parallel_size // max(1, args.nnodes)
    rank = int(os.environ.get("MSTAR_TP_RANK") or args.node_rank * per)
    place = TpPlacement(d.tensor_parallel_size, rank, args.nnodes, args.node_rank, args.master_addr, args.master_port)
    place.check()
    if not place.master_port:
        place = dataclasses.replace(place, master_port=free_port(place.master_addr))
    return place


def join(d: Deployment, place, argv: list[str]):
    """Start this host's other ranks (from its first rank) and join the group."""
    from services.gpu_worker.tp.group import TpGroup, start_local_ranks

    first = place.rank == place.node_ranks[0]
    if first:
        refuse_unservable(d)  # before any rank loads a weight
        share_cores(place.per_node)
    children = start_local_ranks(place, argv) if first else []
    try:
        from services.gpu_worker.build import pick_device

        group = TpGroup.join(place, pick_device().type == "cuda")
    except Exception:
        for p in children:
            p.kill()
        raise
    group.children = children
    return group


def share_cores(ranks: int) -> None:
    """This host's ranks split its cores (a one-rank worker's defaults, each divided by the
    ranks here), unless MSTAR_TORCH_THREADS / MSTAR_COMPUTE_THREADS say; the ranks this one
    starts inherit the settings."""
    from shared.cgroup import available_cpus

    cores = available_cpus()
    os.environ.setdefault("MSTAR_TORCH_THREADS", str(max(1, (cores - 1) // ranks)))
    os.environ.setdefault("MSTAR_COMPUTE_THREADS", str(max(1, cores // ranks)))


def follow(d: Deployment, group) -> int:
    """A rank other than 0: load the shard, then run rank 0's forwards until it stops."""
    import torch

    from services.gpu_worker.build import assemble
    from shared.cgroup import available_cpus

    torch.set_num_threads(int(os.environ.get("MSTAR_TORCH_THREADS") or max(1, available_cpus() - 1)))
    parts = assemble(d, group)
    log.info("rank %d of %d ready; following rank 0", group.rank, group.size)
    parts.model.warm_gemms(d.max_batch_tokens, min(d.max_num_seqs, d.max_batch_tokens))
    parts.engine.runner.follow()  # type: ignore[attr-defined]
    log.info("rank %d: rank 0 said stop", group.rank)
    group.close()
    return 0
