"""`python -m services.data_worker`: tokenize and lay out requests for the conductor."""

from __future__ import annotations

import argparse
import sys

from shared import start_gate
from shared.aio import run_service
from shared.config import (
    add_address_flags,
    add_deployment_flags,
    deployment_from_args,
    resolve_addresses,
)
from shared.logs import add_logging_flags, setup_logging
from shared.memory import release_free_heap
from shared.model_source import ModelSource
from shared.specs.base import DeploymentError

ADDRESSES = ["data_worker", "conductor"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.data_worker",
                                     description="mstar data worker: tokenizer and process_prompt")
    add_deployment_flags(parser)
    add_address_flags(parser, ADDRESSES)
    add_logging_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    start_gate.wait("services.data_worker.data_worker")
    args = build_parser().parse_args(argv)
    log = setup_logging("data_worker", args.log_level, args.log_format)
    d = deployment_from_args(args)
    try:
        source = ModelSource(d.model)
        spec = source.spec(d.page_size, d.max_seq_len, task=d.task)
        tokenizer = source.tokenizer
    except (DeploymentError, FileNotFoundError, ValueError) as exc:
        log.error("cannot start: %s", exc)
        print(f"data_worker: cannot start: {exc}", file=sys.stderr)
        return 2
    from services.data_worker.data_worker import DataWorker

    addrs = resolve_addresses(args, ADDRESSES)
    log.info("listening on %s", addrs["data_worker"])
    worker = DataWorker(spec, tokenizer, addrs)
    release_free_heap()
    run_service(worker.run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
