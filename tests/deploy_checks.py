"""What the compose and Kubernetes tests check of a container's command: the module the
launcher starts, with flags that module's own parser accepts."""

from __future__ import annotations

import importlib
import itertools
import re

from services.launcher import plan_children
from shared.config import ADDRESS_NAMES, Deployment, deployment_argv, deployment_fields, field_env
from tests.servers import REPO

SERVICES = ("api", "data_worker", "conductor", "gpu_worker")
#: flags a container may add to what the launcher passes: addresses peers reach it at,
#: where the api listens
CONTAINER_ONLY = {"--api-advertise-addr", "--advertise-addr", "--host"}
#: flags the launcher passes that a container may leave to the default (the worker id:
#: the host name, so that every replica has its own)
CONTAINER_OPTIONAL = {"--worker-id"}


def flags(argv: list[str]) -> set[str]:
    return {a for a in argv if a.startswith("--")}


def launched() -> dict[str, list[str]]:
    """module -> the flags `mstar serve` starts it with."""
    return {c.argv[2]: c.argv[3:] for c in plan_children(Deployment(), "/run", "127.0.0.1", 8000, 1, [])}


def parser_for(module: str):
    if module == "services.launcher":
        return importlib.import_module(module).build_parser()
    return importlib.import_module(f"{module}.__main__").build_parser()


def check_service_command(name: str, cmd: list[str]) -> None:
    """A service's container command: `python -m services.<name>` with flags its own parser
    accepts, every address flag the launcher passes (deployment settings travel as MSTAR_*
    env vars, not flags), no flag the launcher does not know but CONTAINER_ONLY, and tcp
    addresses (or `auto` for the advertised one)."""
    assert cmd[:2] == ["python", "-m"], name
    module, args = cmd[2], cmd[3:]
    assert module == f"services.{name}", name
    parser_for(module).parse_args(args)
    plan = launched()[module]
    expected = flags(plan) - flags(deployment_argv(Deployment())) - {"--port", "--host"} - CONTAINER_OPTIONAL
    assert expected <= flags(args), (name, expected - flags(args))
    assert flags(args) - flags(plan) <= CONTAINER_ONLY, name
    addrs = [(k, v) for k, v in itertools.pairwise(args) if k.endswith("-addr")]
    assert addrs, name
    for k, v in addrs:
        assert v.startswith("tcp://") or (k == "--advertise-addr" and v == "auto"), (name, k, v)


def settings_read() -> set[str]:
    """Every MSTAR_* env var the services read: the names in their source, each deployment
    field's, and each address's."""
    names = set()
    for path in [*(REPO / "services").rglob("*.py"), *(REPO / "shared").rglob("*.py")]:
        names |= set(re.findall(r"MSTAR_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    names |= {field_env(f.name) for f in deployment_fields()}
    names |= {f"MSTAR_{n.upper()}_ADDR" for n in ADDRESS_NAMES}
    return names


#: settings a container gets as flags instead (addresses, the worker's id, where the api
#: listens) or that only the launcher's ipc run folder uses
SET_PER_CONTAINER = {"MSTAR_RUN_DIR", "MSTAR_WORKER_ADDR", "MSTAR_WORKER_ID", "MSTAR_WORKER_ADVERTISE_ADDR",
                     "MSTAR_API_ADVERTISE_ADDR", "MSTAR_API_HOST", "MSTAR_API_PORT",
                     *(f"MSTAR_{n.upper()}_ADDR" for n in ADDRESS_NAMES),
                     "MSTAR_WORKERS", "MSTAR_START_TIMEOUT",  # `mstar serve`'s own: compose and k8s place workers
                     "MSTAR_MODELS_DIR", "MSTAR_MODELS_MAX",  # ... and start and stop a model's workers
                     "MSTAR_TP_RANK",  # a tensor-parallel rank's, set by the rank that starts it
                     "MSTAR_START_GATE"}  # the launcher's pipe to its children (shared/start_gate.py)
