"""compose.yaml runs, for every service, the module the launcher (and so the tests)
starts, with flags that service's own parser accepts: the launcher's flags plus only
the tcp advertise addresses compose needs across containers."""

from __future__ import annotations

import importlib
import itertools

import yaml

from services.launcher import plan_children
from shared.config import Deployment, deployment_argv
from tests.servers import REPO

CONTAINER_ONLY = {"--api-advertise-addr", "--advertise-addr", "--host"}


def _flags(argv: list[str]) -> set[str]:
    return {a for a in argv if a.startswith("--")}


def test_compose_matches_launcher():
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    launched = {c.argv[2]: c.argv[3:] for c in plan_children(Deployment(), "/run", "127.0.0.1", 8000, 1, [])}
    assert set(launched) == {f"services.{s}" for s in ("api", "data_worker", "conductor", "gpu_worker")}
    seen = set()
    for name, svc in compose["services"].items():
        cmd = svc["command"]
        assert cmd[:2] == ["python", "-m"], name
        module, flags = cmd[2], cmd[3:]
        assert module == f"services.{name}", name
        seen.add(module)
        # The service's own parser accepts exactly these flags.
        parser = importlib.import_module(f"{module}.__main__").build_parser()
        parser.parse_args(flags)
        # Deployment settings travel as MSTAR_* env vars in compose, addresses as flags.
        expected = _flags(launched[module]) - _flags(deployment_argv(Deployment())) - {"--port", "--host"}
        assert expected <= _flags(flags), (name, expected - _flags(flags))
        assert _flags(flags) - _flags(launched[module]) <= CONTAINER_ONLY, name
        # Addresses are tcp across containers.
        addrs = [v for k, v in itertools.pairwise(flags) if k.endswith("-addr")]
        assert addrs and all(a.startswith("tcp://") for a in addrs), name
    assert seen == set(launched)
    assert ("healthcheck" in compose["services"]["api"]
            and "/ready" in str(compose["services"]["api"]["healthcheck"]["test"]))
