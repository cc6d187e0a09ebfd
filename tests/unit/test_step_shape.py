"""The step's shape (issue 28): the scheduler is the one module of the gpu worker that
changes KV state, and the scheduler, the runner and the output processor are peers that
import none of each other, only the step types."""

from __future__ import annotations

import ast
from pathlib import Path

WORKER = Path(__file__).resolve().parents[2] / "services" / "gpu_worker"
#: the KV manager's methods that change state, and what they are called on
CHANGES = {"ingest_request", "reserve_rows", "commit", "drop_scratch", "admit", "remove", "hold", "drop"}
#: the peers, by module path under services.gpu_worker
PEERS = {"scheduler", "runners.base", "outputs", "runners.encdec"}


def _kv_changes(path: Path) -> list[str]:
    """Calls `<...>.kv.<change>(...)` or `kv.<change>(...)` in a module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in CHANGES:
            owner = node.func.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if name == "kv":
                found.append(f"{path.name}:{node.lineno} kv.{node.func.attr}")
    return found


def test_only_the_scheduler_changes_kv_state():
    calls = [c for p in sorted(WORKER.rglob("*.py")) if p.name != "kv_manager.py" for c in _kv_changes(p)]
    assert calls and all(c.startswith("scheduler.py:") for c in calls), calls


def test_scheduler_runner_and_outputs_are_peers():
    for name in PEERS:
        tree = ast.parse((WORKER / f"{name.replace('.', '/')}.py").read_text())
        imported = {n.module.removeprefix("services.gpu_worker.") for n in ast.walk(tree)
                    if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("services.gpu_worker.")}
        others = (PEERS - {name, "runners.base"}) if name == "runners.encdec" else PEERS - {name}
        assert not imported & others, (name, imported & others)  # the Whisper runner extends the runner
        assert name == "scheduler" or "step_types" in imported
