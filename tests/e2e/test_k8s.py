"""deploy/k8s/: the api, data worker and conductor as Deployments and the gpu workers as a
StatefulSet (the pod name is the worker id), every container's command accepted by that
service's own parser (as the compose test checks compose.yaml), readiness on /ready,
liveness on /health, Prometheus scrape annotations, a GPU for the CUDA image, and every
address pointing at a Service port that exists."""

from __future__ import annotations

import re

import pytest
import yaml

from tests.deploy_checks import SERVICES, SET_PER_CONTAINER, check_service_command, launched, parser_for, settings_read
from tests.servers import REPO

K8S = REPO / "deploy" / "k8s"


def _docs() -> list[dict]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in _docs() if d["kind"] == kind}


def _workloads() -> dict[str, dict]:
    """service (api, gpu_worker, ...) -> its Deployment or StatefulSet."""
    found = {}
    for d in _docs():
        if d["kind"] in ("Deployment", "StatefulSet"):
            (container,) = d["spec"]["template"]["spec"]["containers"]
            found[container["command"][2].removeprefix("services.")] = d
    return found


def _container(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]["containers"][0]


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in args, with sample values for the downward API."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)


def test_kustomization_lists_every_manifest():
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}


def test_workload_kinds_and_commands():
    workloads = _workloads()
    assert set(workloads) == set(SERVICES) and {f"services.{s}" for s in SERVICES} == set(launched())
    for name, w in workloads.items():
        assert w["kind"] == ("StatefulSet" if name == "gpu_worker" else "Deployment"), name
        c = _container(w)
        declared = {e["name"] for e in c.get("env", [])}
        argv = [_expand(a, {"POD_NAME": "mstar-gpu-worker-0", "POD_IP": "10.0.0.7"}) for a in c["args"]]
        assert all(re.findall(r"\$\((\w+)\)", a) == [] or set(re.findall(r"\$\((\w+)\)", a)) <= declared
                   for a in c["args"]), name
        check_service_command(name, [*c["command"], *argv])
        assert w["spec"]["selector"]["matchLabels"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
        pod = w["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0


def test_worker_ids_are_the_statefulset_pod_names():
    w = _workloads()["gpu_worker"]
    c = _container(w)
    args = parser_for("services.gpu_worker").parse_args(
        [_expand(a, {"POD_NAME": "mstar-gpu-worker-2", "POD_IP": "10.0.0.9"}) for a in c["args"]])
    assert args.worker_id == "mstar-gpu-worker-2" and args.advertise_addr == "tcp://10.0.0.9:5560"
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"]}
    assert env == {"POD_NAME": "metadata.name", "POD_IP": "status.podIP"}
    headless = _by_kind("Service")[w["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"


def test_probes_metrics_and_gpu():
    workloads = _workloads()
    api = _container(workloads["api"])
    port = int(api["args"][api["args"].index("--port") + 1])
    assert api["readinessProbe"]["httpGet"] == {"path": "/ready", "port": port}
    assert api["livenessProbe"]["httpGet"] == {"path": "/health", "port": port}
    notes = workloads["api"]["spec"]["template"]["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/path"] == "/metrics"
    assert int(notes["prometheus.io/port"]) == port
    worker = _container(workloads["gpu_worker"])
    assert worker["image"].startswith("mstar-cuda")
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    for name in ("conductor", "data_worker", "gpu_worker"):  # no HTTP: alive while the bound port accepts
        c = _container(workloads[name])
        bound = {int(a.rsplit(":", 1)[1]) for a in c["args"] if a.startswith("tcp://0.0.0.0:")}
        assert c["livenessProbe"]["tcpSocket"]["port"] in bound, name


def test_addresses_point_at_service_ports():
    services = _by_kind("Service")
    workloads = _workloads()
    for name, w in workloads.items():
        for arg in _container(w)["args"]:
            m = re.fullmatch(r"tcp://([a-z0-9-]+):(\d+)", arg)
            if m is None or m.group(1) == "0":
                continue
            svc = services[m.group(1)]
            assert int(m.group(2)) in {p["port"] for p in svc["spec"]["ports"]}, (name, arg)
            target = next(x for x in workloads.values()
                          if svc["spec"]["selector"].items() <= x["spec"]["template"]["metadata"]["labels"].items())
            assert int(m.group(2)) in {p["containerPort"] for p in _container(target)["ports"]}, (name, arg)


@pytest.mark.parametrize("name", SERVICES)
def test_settings_come_from_the_shared_configmap(name):
    c = _container(_workloads()[name])
    refs = [next(iter(e.values()))["name"] for e in c["envFrom"]]
    assert refs[0] == "mstar-config" and "mstar-secrets" in refs
    config = _by_kind("ConfigMap")["mstar-config"]["data"]
    assert set(config) <= settings_read() - SET_PER_CONTAINER


def test_check_job_runs_the_deployment_check():
    (job,) = _by_kind("Job").values()
    c = job["spec"]["template"]["spec"]["containers"][0]
    argv = [*c["command"], *c["args"]]
    assert argv[:4] == ["python", "-m", "services.launcher", "check"]
    assert parser_for("services.launcher").parse_args(argv[3:]).command == "check"
    assert job["spec"]["backoffLimit"] == 0
