"""`python -m services.conductor`: validate the deployment, then admit and route requests."""

from __future__ import annotations

import argparse
import sys

from shared import start_gate
from shared.config import (
    add_address_flags,
    add_deployment_flags,
    deployment_from_args,
    resolve_addresses,
)
from shared.logs import add_logging_flags, setup_logging
from shared.memory import release_free_heap
from shared.model_source import ModelSource
from shared.models import add_models_flags, models_from_args
from shared.specs.base import DeploymentError, ModelSpec

ADDRESSES = ["conductor", "conductor_control"]


def validate_deployment(model: str, page_size: int, max_seq_len: int, task: str = "auto") -> ModelSpec:
    """Everything that can be refused before any worker starts: the model resolves, its
    architecture is supported, a GGUF file's tokenizer (its model and pre-tokenizer) is one
    mstar rebuilds, and every paged pool is used by a declared label."""
    source = ModelSource(model)
    spec = source.spec(page_size, max_seq_len, task=task)
    spec.validate()
    if source.kind == "gguf":
        from shared.gguf_source import check_gguf_tokenizer
        from shared.gguf_tokenizer import UnsupportedGGUFTokenizer

        try:
            check_gguf_tokenizer(source.path)
        except UnsupportedGGUFTokenizer as exc:
            raise DeploymentError(f"{source.path.name}: {exc}") from None
    return spec


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.conductor",
                                     description="mstar conductor: deployment validation, loop caps, "
                                                 "admission by KV footprint, routing")
    add_deployment_flags(parser)
    add_models_flags(parser, models_max=True)
    add_address_flags(parser, ADDRESSES)
    add_logging_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    start_gate.wait("shared.aio", "services.conductor.conductor")
    args = build_parser().parse_args(argv)
    log = setup_logging("conductor", args.log_level, args.log_format)
    d = deployment_from_args(args)
    # here, not at the top: the launcher imports validate_deployment alone (its preflight)
    # and would carry the event loop, ZMQ and the frames for the rest of its life
    from shared.aio import run_service
    from shared.fingerprint import fingerprint

    try:
        served = models_from_args(args)
        if served:
            return _run_fleet(args, d, served)
        spec = validate_deployment(d.model, d.page_size, d.max_seq_len, d.task)
        ours = fingerprint(d)
    except (DeploymentError, FileNotFoundError, ValueError) as exc:
        log.error("deployment refused: %s", exc)
        print(f"conductor: deployment refused: {exc}", file=sys.stderr)
        return 2
    from services.conductor.conductor import Conductor

    addrs = resolve_addresses(args, ADDRESSES)
    log.info("listening on %s (control %s) for model %s", addrs["conductor"], addrs["conductor_control"], ours.model)
    conductor = Conductor(d, spec, addrs, ours)
    release_free_heap()  # what reading the model's config and spec freed
    run_service(conductor.run())
    return 0


def _run_fleet(args: argparse.Namespace, d, served) -> int:
    """Several models: each validated and fingerprinted as one model is, then one
    `Fleet` keeps a conductor per model behind this process's sockets."""
    import msgspec

    from services.conductor.fleet import Fleet
    from shared.aio import run_service
    from shared.fingerprint import fingerprint

    entries = []
    for m in served:
        md = msgspec.structs.replace(d, model=m.model)
        entries.append((m, validate_deployment(m.model, d.page_size, d.max_seq_len, d.task), fingerprint(md)))
    fleet = Fleet(d, entries, resolve_addresses(args, ADDRESSES), args.models_max)
    release_free_heap()
    run_service(fleet.run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
