"""compose.yaml runs, for every service, the module the launcher (and so the tests)
starts, with flags that service's own parser accepts: the launcher's flags plus only
the tcp advertise addresses compose needs across containers. `--scale gpu_worker=N` gives
each replica its own id and address, every MSTAR_* setting passes through, and a bad model
stops at the one-shot `check` service instead of restarting in a loop. The Dockerfiles run
as a non-root user with a HEALTHCHECK."""

from __future__ import annotations

import re
import socket

import yaml

from shared.config import advertised
from tests.deploy_checks import (
    SERVICES,
    SET_PER_CONTAINER,
    check_service_command,
    launched,
    parser_for,
    settings_read,
)
from tests.servers import REPO


def _compose() -> dict:
    return yaml.safe_load((REPO / "compose.yaml").read_text())


def test_compose_matches_launcher():
    compose = _compose()
    services = {n: s for n, s in compose["services"].items() if n != "check"}
    assert {f"services.{n}" for n in services} == set(launched()) == {f"services.{s}" for s in SERVICES}
    for name, svc in services.items():
        check_service_command(name, svc["command"])
    assert ("healthcheck" in compose["services"]["api"]
            and "/ready" in str(compose["services"]["api"]["healthcheck"]["test"]))


def test_a_bad_model_stops_at_the_check_instead_of_restarting():
    compose = _compose()
    check = compose["services"]["check"]
    assert check["command"][:4] == ["python", "-m", "services.launcher", "check"]
    assert parser_for("services.launcher").parse_args(check["command"][3:]).command == "check"
    assert check["restart"] == "no"
    for name in SERVICES:
        svc = compose["services"][name]
        assert svc["depends_on"]["check"] == {"condition": "service_completed_successfully"}, name
        # a crash restarts, a few times in a row at most
        assert re.fullmatch(r"on-failure:\d+", svc["restart"]), (name, svc["restart"])


def test_scaled_workers_get_their_own_ids_and_addresses(monkeypatch):
    worker = _compose()["services"]["gpu_worker"]
    assert "container_name" not in worker and "ports" not in worker and "hostname" not in worker
    args = worker["command"][3:]
    assert "--worker-id" not in args and args[args.index("--advertise-addr") + 1] == "auto"
    ids = set()
    for host in ("3f2a9c1b0d4e", "77aa01bc92ef", "c0ffee123456"):  # containers' host names
        monkeypatch.setattr(socket, "gethostname", lambda host=host: host)
        ids.add(parser_for("services.gpu_worker").parse_args(args).worker_id)
    assert len(ids) == 3
    monkeypatch.setattr(socket, "gethostname", lambda: "localhost")
    bind = args[args.index("--bind-addr") + 1]
    assert advertised(bind, "auto") == "tcp://127.0.0.1:5560"


def test_every_mstar_setting_passes_through():
    compose = _compose()
    for name, svc in compose["services"].items():
        env = svc["environment"]
        missing = settings_read() - SET_PER_CONTAINER - set(env)
        assert not missing, (name, sorted(missing))
        # unset in the shell: unset in the container (the service's default), never ""
        assert all(v is None for v in env.values()), name


def test_dockerfiles_non_root_with_healthcheck():
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".git", ".venv", "**/__pycache__"} <= set(ignored)
    for name in ("Dockerfile", "Dockerfile.cuda"):
        text = (REPO / name).read_text()
        users = re.findall(r"^USER (\S+)", text, re.M)
        assert users and users[-1] not in ("root", "0"), name
        assert re.search(r"^HEALTHCHECK .*\n?.*/health", text, re.M), name
        cmd = re.findall(r"^CMD (\[.*\])$", text, re.M)[-1]
        argv = yaml.safe_load(cmd)
        assert argv[:4] == ["python", "-m", "services.launcher", "serve"], name
        parser_for("services.launcher").parse_args(argv[3:])
    assert 'pip install ".[cuda]"' in (REPO / "Dockerfile.cuda").read_text()


def test_cuda_override_puts_the_worker_on_a_gpu():
    override = yaml.safe_load((REPO / "compose.cuda.yaml").read_text())["services"]
    assert set(override) == {"gpu_worker"}  # the command, env and restarts stay compose.yaml's
    worker = override["gpu_worker"]
    assert worker["build"]["dockerfile"] == "Dockerfile.cuda" and (REPO / "Dockerfile.cuda").exists()
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert "command" not in worker and "environment" not in worker


def test_one_service_builds_the_image_and_the_others_run_it():
    """`up` builds the image once (five `build: .` built it five times), and a builder with
    no Docker Hub or PyTorch index sets the base image and the torch index."""
    services = _compose()["services"]
    assert [n for n, s in services.items() if "build" in s] == ["check"]
    assert len({s["image"] for s in services.values()}) == 1
    assert all(s["pull_policy"] == "never" for n, s in services.items() if n != "check")
    args = services["check"]["build"]["args"]
    assert args == {"BASE_IMAGE": "${MSTAR_BASE_IMAGE:-python:3.11-slim}",
                    "TORCH_INDEX_URL": "${MSTAR_TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"}
    for name in ("Dockerfile", "Dockerfile.cuda"):
        text = (REPO / name).read_text()
        assert "ARG TORCH_INDEX_URL=" in text and '--index-url "${TORCH_INDEX_URL}"' in text, name
    assert "ARG BASE_IMAGE=python:3.11-slim\nFROM ${BASE_IMAGE}" in (REPO / "Dockerfile").read_text()


def test_the_api_turns_unhealthy_soon_after_the_last_worker_goes():
    hc = _compose()["services"]["api"]["healthcheck"]
    interval = int(hc["interval"].rstrip("s"))
    assert interval * hc["retries"] <= 20  # was 5 s x 60: 'healthy' for 5 minutes with no worker
    assert "/ready" in str(hc["test"])
