"""`python -m services.gpu_worker`: load the model, announce to the conductor, serve steps."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from shared import start_gate
from shared.config import (
    add_address_flags,
    add_deployment_flags,
    advertised,
    deployment_from_args,
    env_address,
    resolve_addresses,
)
from shared.logs import add_logging_flags, setup_logging
from shared.specs.base import DeploymentError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.gpu_worker",
                                     description="mstar gpu worker: the model, paged KV pools and the step loop")
    add_deployment_flags(parser)
    add_address_flags(parser, ["conductor"])
    parser.add_argument("--worker-id", default=os.environ.get("MSTAR_WORKER_ID") or socket.gethostname(),
                        help="this worker's id, unique among the conductor's workers (env MSTAR_WORKER_ID; "
                             "default: the host name, so every container or StatefulSet pod has its own)")
    parser.add_argument("--bind-addr", default=None,
                        help="where this worker pulls work "
                             "(env MSTAR_WORKER_ADDR; default ipc in the run folder, one per worker id)")
    parser.add_argument("--advertise-addr", default=os.environ.get("MSTAR_WORKER_ADVERTISE_ADDR"),
                        help="address the conductor connects to, when the bind address is not reachable as-is; "
                             "'auto': the bind's port at this host's IP (for scaled containers) "
                             "(env MSTAR_WORKER_ADVERTISE_ADDR; default: the bind address)")
    add_tp_flags(parser)
    add_logging_flags(parser)
    return parser


def add_tp_flags(parser: argparse.ArgumentParser) -> None:
    """Where the ranks of a `--tensor-parallel-size` group meet, as torch.distributed's
    launchers name it (one host needs none of these)."""
    env = os.environ.get
    parser.add_argument("--master-addr", default=env("MSTAR_MASTER_ADDR") or "127.0.0.1",
                        help="host of the group's rank 0, which every rank reaches (env MSTAR_MASTER_ADDR; "
                             "default 127.0.0.1)")
    parser.add_argument("--master-port", type=int, default=int(env("MSTAR_MASTER_PORT") or 0),
                        help="TCP port the group meets on at --master-addr (env MSTAR_MASTER_PORT; default: a free "
                             "port, one host only)")
    parser.add_argument("--nnodes", type=int, default=int(env("MSTAR_NNODES") or 1),
                        help="hosts the group's ranks spread over, each running tensor_parallel_size / nnodes "
                             "(env MSTAR_NNODES; default 1)")
    parser.add_argument("--node-rank", type=int, default=int(env("MSTAR_NODE_RANK") or 0),
                        help="this host's index among --nnodes: 0 runs rank 0, the worker the conductor knows; "
                             "the others run only ranks that follow it (env MSTAR_NODE_RANK; default 0)")


def main(argv: list[str] | None = None) -> int:
    start_gate.wait("services.gpu_worker.worker")  # torch: most of a start, overlapping the launcher's check
    args = build_parser().parse_args(argv)
    log = setup_logging(f"gpu_worker:{args.worker_id}", args.log_level, args.log_format)
    bind = args.bind_addr or os.environ.get("MSTAR_WORKER_ADDR") or env_address(f"gpu_worker_{args.worker_id}")

    addrs = resolve_addresses(args, ["conductor"])
    d = deployment_from_args(args)
    group = None
    try:
        if d.tensor_parallel_size > 1:  # the other ranks start first: their imports overlap this one's
            from services.gpu_worker.tp import main as tp_main

            group = tp_main.join(d, tp_main.placement(args, d), argv if argv is not None else sys.argv[1:])
            if group.rank != 0:  # a rank that follows rank 0's plans; it never talks to the conductor
                return tp_main.follow(d, group)
        from services.gpu_worker.worker import GpuWorker

        worker = GpuWorker(d, bind, advertised(bind, args.advertise_addr), addrs["conductor"], args.worker_id, group)
    except (DeploymentError, FileNotFoundError, ValueError, NotImplementedError) as exc:
        log.error("cannot start: %s", exc)
        print(f"gpu_worker: cannot start: {exc}", file=sys.stderr)
        if group is not None:
            group.close_children()
        return 2
    log.info("ready at %s", bind)
    worker.serve()
    if worker.refused is not None:  # a configuration error: restarting cannot fix it
        print(f"gpu_worker: refused by the conductor: {worker.refused}", file=sys.stderr, flush=True)
        return 2
    return worker.exit_code


def exit_now(code: int) -> None:
    """End the process once `main` has closed everything it opened (the sockets, the ZMQ
    context, a tensor-parallel group and its ranks): the log's handlers and stdio flushed,
    then `os._exit`. The interpreter's own teardown of torch's module graph took ~0.7 s of
    CPU at every stop and frees nothing the OS does not (an exception still exits as
    Python does: with its traceback)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
