"""What a worker loaded, compared with what the conductor serves, at registration.

Across hosts nothing but this check stops a worker started with another model (or another
page size, dtype, ...) from joining a conductor and answering its requests with the wrong
weights or the wrong KV layout. Every worker's `WorkerReady` carries a `Fingerprint`; the
conductor refuses one that differs from its own (`WorkerRefused`, a log line naming both),
and the refused worker exits with status 2.

- model: its served name (Hub id, folder name, .gguf stem) and a sha256 of its config and
  of the names and sizes of its weight files, so the same checkpoint mounted at another path
  agrees, while another checkpoint (or another revision of it) does not. Weights are not
  read: a file with the same name and size but other bytes is not caught.
- deployment: every `Deployment` field but the model and the ones each worker sizes to its
  own hardware (`PER_WORKER`).
"""

from __future__ import annotations

import hashlib
import json

import msgspec

from shared.config import Deployment
from shared.frames import Fingerprint

#: Deployment fields a worker may set for itself (its memory, its batch): the conductor plans
#: against each worker's announced pools, so these need not agree (nor the conductor's own
#: queue timeout, which no worker reads).
PER_WORKER = frozenset({"model", "num_kv_pages", "kv_memory_fraction", "max_num_seqs", "max_batch_tokens",
                        "itl_target_ms", "queue_timeout_s"})


def model_identity(model: str) -> str:
    """`name (sha256 <12 hex>)` of the model `--model` names (as `ModelSource` resolves it)."""
    from shared.model_source import ModelSource

    source = ModelSource(model)
    h = hashlib.sha256(json.dumps(source.config, sort_keys=True, default=str).encode())
    path = source.path
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    for f in files:
        h.update(f"\0{f.name}\0{f.stat().st_size}".encode())
    return f"{source.name} (sha256 {h.hexdigest()[:12]})"


def deployment_identity(d: Deployment) -> str:
    """The fields every worker must share with the conductor, as canonical JSON."""
    values = msgspec.to_builtins(d)
    return json.dumps({k: v for k, v in sorted(values.items()) if k not in PER_WORKER}, separators=(",", ":"))


def fingerprint(d: Deployment) -> Fingerprint:
    return Fingerprint(model_identity(d.model), deployment_identity(d))


def mismatch(ours: Fingerprint, theirs: Fingerprint | None) -> str | None:
    """None when a worker announcing `theirs` may join a conductor holding `ours`; else the
    reason, naming both sides."""
    if theirs is None:
        return f"it sent no fingerprint (an older or foreign worker); this conductor serves {ours.model}"
    parts = []
    if theirs.model != ours.model:
        parts.append(f"it loaded model {theirs.model}, this conductor serves {ours.model}")
    if theirs.deployment != ours.deployment:
        mine, its = json.loads(ours.deployment), json.loads(theirs.deployment)
        diff = sorted(k for k in mine.keys() | its.keys() if mine.get(k) != its.get(k))
        parts.append("its deployment differs in " + ", ".join(
            f"{k} (worker {json.dumps(its.get(k))}, conductor {json.dumps(mine.get(k))})" for k in diff))
    return "; ".join(parts) or None
