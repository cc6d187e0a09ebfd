"""`mstar serve`: start the four services as child processes and supervise them.

Before any child starts, the launcher runs the conductor's deployment check in-process
(`validate_deployment`: the model resolves, a Hub id is in the local cache, the
architecture is supported) and reads a `--chat-template` file: a refusal is one line,
`mstar: deployment refused: <why>`, and exit code 2, with no worker loading weights.
The services start while that check runs, each behind a start gate (shared/start_gate.py):
they do their imports (the gpu worker's torch, most of a start) and wait for the verdict,
leaving silently on a refusal. The conductor first, the gpu worker(s), the data worker and
the api. `serve` returns only when stopped:
SIGINT/SIGTERM stop every child (SIGTERM, then SIGKILL after a grace period), and a
child that dies at start makes the launcher stop the rest and exit non-zero with that
child's error (its stderr is the launcher's). Children get PR_SET_PDEATHSIG, so even a
SIGKILLed launcher leaves no child behind.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
from dataclasses import dataclass

import msgspec

from shared.config import Deployment, add_deployment_flags, deployment_argv, deployment_from_args
from shared.generation_config import FLAG_HELP as GENERATION_FLAG_HELP
from shared.logs import add_logging_flags
from shared.memory import release_free_heap
from shared.models import MODELS_MAX_ENV, ServedModel, check_names, encode_models, models_in_dir
from shared.start_gate import GATE_ENV, GO

PR_SET_PDEATHSIG = 1
GRACE_S = 10.0  # per stage of shutdown: the api drains first, then the rest stop
STABLE_S = 30.0  # a child that lived this long is no longer crash-looping
MAX_BACKOFF_S = 30.0
#: how often start-up asks /ready (a poll is one local HTTP request; ready is seen this much later at most)
READY_POLL_S = 0.05
#: several models: how often the launcher asks which are wanted loaded
MODELS_POLL_S = 0.25


def _die_with_parent() -> None:
    """Runs in the child before exec: deliver SIGTERM when the launcher dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def http_get(url: str, headers: dict[str, str] | None = None, timeout: float = 1.0) -> tuple[int, bytes]:
    """GET `url` (plain http, the launcher's own api on this host): (status, body). An
    HTTP/1.0 request on a socket, read to the server's close: urllib would bring ssl,
    http.client and email, ~8 MiB of a process that only supervises (issue 49)."""
    parts = urllib.parse.urlsplit(url)
    lines = [f"GET {parts.path or '/'} HTTP/1.0", f"Host: {parts.netloc}",
             *(f"{k}: {v}" for k, v in (headers or {}).items())]
    chunks = []
    with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 80), timeout=timeout) as conn:
        conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        while data := conn.recv(65536):
            chunks.append(data)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0  # consecutive quick deaths, for the crash-loop back-off
    restart_at: float | None = None
    #: the served model whose gpu worker this is (several models: it runs while wanted)
    model: str | None = None
    wanted: bool = True
    #: when it was asked to stop because its model was unloaded (None: it was not)
    retiring: float | None = None

    def start(self, env: dict[str, str], pass_fds: tuple[int, ...] = ()) -> None:
        self.proc = subprocess.Popen(self.argv, env=env, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent,
                                     pass_fds=pass_fds)
        self.started_at = time.monotonic()
        self.restart_at = None

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()


def plan_children(d: Deployment, run_dir: str, host: str, port: int, workers: int, api_flags: list[str],
                  master_port: int = 0) -> list[Child]:
    """The command line of every service, with ipc addresses in one run folder."""
    py = [sys.executable, "-m"]
    addr = {n: f"ipc://{os.path.join(run_dir, n)}.sock"
            for n in ("api", "data-worker", "conductor", "conductor-control")}
    dflags = deployment_argv(d)
    children = [Child("conductor", [
        *py, "services.conductor", *dflags,
        "--conductor-addr", addr["conductor"], "--conductor-control-addr", addr["conductor-control"],
    ])]
    for i in range(workers):
        # a tensor-parallel group each: its own port where one is given (else each picks a free one)
        group_port = ["--master-port", str(master_port + i)] if master_port else []
        children.append(Child(f"gpu_worker-{i}", [
            *py, "services.gpu_worker", *dflags, "--worker-id", f"worker-{i}",
            "--bind-addr", f"ipc://{os.path.join(run_dir, f'gpu-worker-{i}')}.sock",
            "--conductor-addr", addr["conductor"], *group_port,
        ]))
    children.append(Child("data_worker", [
        *py, "services.data_worker", *dflags,
        "--data-worker-addr", addr["data-worker"], "--conductor-addr", addr["conductor"],
    ]))
    children.append(Child("api", [
        *py, "services.api", *dflags, "--host", host, "--port", str(port), "--api-addr", addr["api"],
        "--data-worker-addr", addr["data-worker"], "--conductor-addr", addr["conductor"],
        "--conductor-control-addr", addr["conductor-control"], *api_flags,
    ]))
    return children


def plan_fleet(d: Deployment, run_dir: str, host: str, port: int, workers: int, api_flags: list[str],
               models: list[ServedModel], models_max: int) -> list[Child]:
    """Several models: one conductor and one api for all of them; per model a data worker
    (always running: a tokenizer is cheap) and `workers` gpu workers, which run while the
    conductor wants the model loaded (the first `models_max` at start, all with 0)."""
    py = [sys.executable, "-m"]
    addr = {n: f"ipc://{os.path.join(run_dir, n)}.sock" for n in ("conductor", "conductor-control")}
    placed = [msgspec.structs.replace(m, data_worker_addr=f"ipc://{os.path.join(run_dir, f'data-worker-m{i}')}.sock",
                                      api_addr=f"ipc://{os.path.join(run_dir, f'api-m{i}')}.sock")
              for i, m in enumerate(models)]
    listed = encode_models(placed)
    children = [Child("conductor", [
        *py, "services.conductor", *deployment_argv(d), "--models", listed, "--models-max", str(models_max),
        "--conductor-addr", addr["conductor"], "--conductor-control-addr", addr["conductor-control"],
    ])]
    cap = len(models) if models_max <= 0 else models_max
    for i, m in enumerate(placed):
        dflags = deployment_argv(msgspec.structs.replace(d, model=m.model))
        for j in range(workers):
            children.append(Child(f"gpu_worker-{m.name}-{j}", [
                *py, "services.gpu_worker", *dflags, "--worker-id", f"worker-m{i}-{j}",
                "--bind-addr", f"ipc://{os.path.join(run_dir, f'gpu-worker-m{i}-{j}')}.sock",
                "--conductor-addr", addr["conductor"],
            ], model=m.name, wanted=i < cap))
        children.append(Child(f"data_worker-{m.name}", [
            *py, "services.data_worker", *dflags,
            "--data-worker-addr", m.data_worker_addr, "--conductor-addr", addr["conductor"],
        ]))
    children.append(Child("api", [
        *py, "services.api", *deployment_argv(d), "--models", listed, "--host", host, "--port", str(port),
        "--conductor-addr", addr["conductor"], "--conductor-control-addr", addr["conductor-control"], *api_flags,
    ]))
    return children


class Launcher:
    def __init__(self, children: list[Child], ready_url: str, run_dir: str, start_timeout: float) -> None:
        self.children = children
        self.ready_url = ready_url
        self.run_dir = run_dir
        self.start_timeout = start_timeout
        self.stopping = False
        #: several models: which are wanted loaded, polled from the api's GET /models
        self.models_url = ready_url.rsplit("/", 1)[0] + "/models" if any(c.model for c in children) else None
        self._polled = 0.0
        #: the write end of the start gate while the deployment check runs (None: open)
        self._gate: int | None = None

    def _on_signal(self, signum, _frame) -> None:
        self.stopping = True

    def _env(self) -> dict[str, str]:
        return dict(os.environ, MSTAR_RUN_DIR=self.run_dir)

    def start_gated(self) -> None:
        """Start every wanted child behind the start gate (shared/start_gate.py): each does
        its imports, then waits for `open_gate` (or leaves at `refuse`)."""
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        read, self._gate = os.pipe()
        env = dict(self._env(), **{GATE_ENV: str(read)})
        try:
            for child in self.children:
                if child.wanted:
                    child.start(env, pass_fds=(read,))
        finally:
            os.close(read)

    def open_gate(self) -> None:
        """The deployment passed: one go byte per gated child (a pipe holds far more)."""
        if self._gate is not None:
            os.write(self._gate, GO * sum(c.proc is not None for c in self.children))
            os.close(self._gate)
            self._gate = None

    def refuse(self) -> None:
        """The deployment was refused: the gated children have only imported, so they are
        killed outright (silently: no output of theirs follows the launcher's one line)."""
        for child in self.children:
            if child.proc is not None and child.poll() is None:
                child.proc.kill()
        for child in self.children:
            if child.proc is not None:
                child.proc.wait()
        if self._gate is not None:
            os.close(self._gate)
            self._gate = None
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def run(self) -> int:
        """Supervise until stopped; the children started (behind the gate, then opened)
        unless `start_gated` ran, in which case they are running already."""
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        env = self._env()
        try:
            if not any(c.proc is not None for c in self.children):
                self.start_gated()
            self.open_gate()
            code = self._wait_ready()
            if code is not None:
                return code
            say(f"mstar: ready on {self.ready_url.rsplit('/', 1)[0]}")
            release_free_heap()  # what the preflight check freed (a first start parses the model)
            while not self.stopping:
                self._poll_models()
                self._supervise(env)
                time.sleep(0.1)
            return 0
        finally:
            self.stop()

    def _supervise(self, env: dict[str, str]) -> None:
        """Restart a child that died after start-up, backing off exponentially while it
        keeps dying quickly (a crash loop is logged, not hidden, and not a busy loop)."""
        now = time.monotonic()
        for child in self.children:
            code = child.poll()
            if not child.wanted:
                self._retire(child, code, now)
                continue
            if child.retiring is not None or child.proc is None:  # its model is wanted (again)
                if code is None and child.proc is not None:
                    continue  # the old process still stops: start the new one after it
                say(f"mstar: {child.name} starting (model {child.model} loads)")
                child.retiring = None
                child.start(env)
                continue
            if code is None:
                if child.restarts and now - child.started_at > STABLE_S:
                    child.restarts = 0
                continue
            if child.restart_at is None:
                delay = min(MAX_BACKOFF_S, 0.5 * 2**child.restarts)
                child.restarts += 1
                child.restart_at = now + delay
                kind = "crash loop: " if child.restarts > 3 else ""
                say(f"mstar: {kind}{child.name} exited with code {code}; "
                    f"restarting in {delay:.1f}s (restart {child.restarts})", "ERROR")
            elif now >= child.restart_at:
                child.start(env)

    def _retire(self, child: Child, code: int | None, now: float) -> None:
        """Stop a gpu worker of an unloaded model: SIGTERM, SIGKILL past the grace period."""
        if child.proc is None or code is not None:
            return
        if child.retiring is None:
            say(f"mstar: {child.name} stopping (model {child.model} unloaded)")
            child.retiring = now
            child.proc.send_signal(signal.SIGTERM)
        elif now - child.retiring > GRACE_S:
            child.proc.kill()

    def _poll_models(self) -> None:
        """Several models: which the conductor wants loaded (the api's GET /models, whose
        `wanted` it reports); a child of a model not wanted is stopped, one wanted started."""
        if self.models_url is None or time.monotonic() - self._polled < MODELS_POLL_S:
            return
        self._polled = time.monotonic()
        headers = {"Authorization": f"Bearer {os.environ['MSTAR_API_KEY']}"} if os.environ.get("MSTAR_API_KEY") else {}
        try:
            status, body = http_get(self.models_url, headers)
            if status != 200:
                return
            listed = json.loads(body)["data"]
        except (OSError, ValueError, KeyError):
            return  # the api or the conductor restarts: keep what runs
        wanted = {m["id"]: bool(m.get("wanted")) for m in listed if "wanted" in m}
        for child in self.children:
            if child.model in wanted:
                child.wanted = wanted[child.model]

    def _dead(self) -> Child | None:
        return next((c for c in self.children if c.poll() is not None), None)

    def _wait_ready(self) -> int | None:
        deadline = time.monotonic() + self.start_timeout
        while not self.stopping:
            dead = self._dead()
            if dead is not None:
                say(f"mstar: {dead.name} failed to start (exit code {dead.poll()}); see its error above", "ERROR")
                return 1
            try:
                if http_get(self.ready_url)[0] == 200:
                    return None
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                say(f"mstar: not ready after {self.start_timeout:.0f}s; stopping", "ERROR")
                return 1
            time.sleep(READY_POLL_S)
        return 0

    def stop(self) -> None:
        """Stop the api first (it refuses new requests with 503 and lets running ones
        finish), then the other services; SIGKILL whatever outlives the grace period."""
        front = [c for c in self.children if c.name == "api"]
        rest = [c for c in self.children if c.name != "api"]
        for group in (front, rest):
            for child in group:
                if child.proc is not None and child.poll() is None:  # a start that failed left later ones unstarted
                    child.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + GRACE_S
            for child in group:
                if child.proc is None:
                    continue
                try:
                    child.proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    child.proc.kill()
                    child.proc.wait()
        shutil.rmtree(self.run_dir, ignore_errors=True)


class _ModelAction(argparse.Action):
    """`mstar serve MODEL` and `--model MODEL` both set `model` (the first one given);
    `--model` repeated with other values serves several models (`model_list`); MODEL and a
    different `--model` are a usage error (the same one twice is fine)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if values is None:  # the positional MODEL, absent
            return
        given = list(getattr(namespace, "model_list", None) or [])
        positional = getattr(namespace, "_model_positional", None)
        if option_string is None:
            positional = namespace._model_positional = values
        if positional is not None and any(g != values for g in given):
            parser.error(f"the model is given twice, as {given[0]!r} and {values!r}; give MODEL or --model, "
                         "not both (repeat --model to serve several models)")
        if values not in given:
            given.append(values)
        namespace.model_list = given
        namespace.model = given[0]


MODEL_HELP = ("a local Hugging Face folder, a .gguf file, or a Hugging Face Hub id (org/name) already in the local "
              "Hugging Face cache (nothing is downloaded; $HF_HOME/hub); "
              "(env MSTAR_MODEL; default: empty, the embedded SmolLM2-135M-Instruct)")


MODEL_FLAG_HELP = "the same as MODEL (env MSTAR_MODEL; default: empty, the embedded SmolLM2-135M-Instruct)"
CHAT_TEMPLATE_HELP = ("a Jinja chat template file that replaces the checkpoint's "
                      "(env MSTAR_CHAT_TEMPLATE; default: the checkpoint's own)")


def build_parser() -> argparse.ArgumentParser:
    from shared.version import mstar_version

    version = f"mstar {mstar_version()}"
    parser = argparse.ArgumentParser(prog="mstar", description="mstar: a serving engine for generative models")
    parser.add_argument("--version", action="version", version=version)
    sub = parser.add_subparsers(dest="command", required=True)
    # "resolve": the --model below replaces add_deployment_flags' (it also takes MODEL)
    serve = sub.add_parser("serve", help="start the api, data worker, conductor and gpu worker(s)",
                           conflict_handler="resolve")
    serve.add_argument("model", nargs="?", metavar="MODEL", default=None, action=_ModelAction, help=MODEL_HELP)
    add_deployment_flags(serve)
    serve.add_argument("--model", dest="model", default=None, action=_ModelAction, help=MODEL_FLAG_HELP)
    serve.add_argument("--served-model-name", default=os.environ.get("MSTAR_SERVED_MODEL_NAME") or None,
                       help="the name /v1/models lists and OpenAI requests must give as `model`, when one model "
                            "is served "
                            "(env MSTAR_SERVED_MODEL_NAME; default: the Hub id, the folder's name or the .gguf's stem)")
    _add_models_flags(serve)
    serve.add_argument("--chat-template", default=os.environ.get("MSTAR_CHAT_TEMPLATE") or None,
                       help=CHAT_TEMPLATE_HELP)
    serve.add_argument("--tool-call-parser", default=os.environ.get("MSTAR_TOOL_CALL_PARSER") or "auto",
                       choices=("auto", "hermes", "llama3_json", "mistral", "mistral_args"),
                       help="the format the model writes tool calls in: auto (chosen from the chat template), "
                            "hermes, llama3_json, mistral or mistral_args (env MSTAR_TOOL_CALL_PARSER; default auto)")
    serve.add_argument("--generation-config", default=os.environ.get("MSTAR_GENERATION_CONFIG") or "auto",
                       help=GENERATION_FLAG_HELP)
    serve.add_argument("--host", default=os.environ.get("MSTAR_API_HOST") or "127.0.0.1",
                       help="address the HTTP api binds (env MSTAR_API_HOST; default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=int(os.environ.get("MSTAR_API_PORT") or 8000),
                       help="HTTP port (env MSTAR_API_PORT; default 8000)")
    serve.add_argument("--workers", type=int, default=int(os.environ.get("MSTAR_WORKERS") or 1),
                       help="gpu worker processes (data parallel) (env MSTAR_WORKERS; default 1)")
    serve.add_argument("--api-key", default=None,
                       help="require Authorization: Bearer KEY on every route but /health and /ready "
                            "(env MSTAR_API_KEY; default: none, no key needed); passed to the api by environment, "
                            "not argv, so ps does not show it")
    serve.add_argument("--max-body-bytes", type=int, default=None,
                       help="largest request body (audio uploads included) the api accepts; "
                            "larger is a 413 (env MSTAR_MAX_BODY_BYTES; default 1 MiB, 64 MiB for a model that "
                            "takes images)")
    _add_media_flags(serve)
    _add_group_flags(serve)
    serve.add_argument("--start-timeout", type=float, default=float(os.environ.get("MSTAR_START_TIMEOUT") or 900),
                       help="seconds to wait for /ready (env MSTAR_START_TIMEOUT; default 900)")
    add_logging_flags(serve)
    serve.add_argument("--enable-prompt-tokens-details", action="store_true",
                       default=os.environ.get("MSTAR_ENABLE_PROMPT_TOKENS_DETAILS", "").lower() in ("1", "true", "on"),
                       help="usage reports the prompt tokens the prefix cache served (OpenAI's "
                            "prompt_tokens_details.cached_tokens, as vLLM's flag) (default: off; "
                            "env MSTAR_ENABLE_PROMPT_TOKENS_DETAILS=1)")
    serve.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=None,
                       help="the api logs one line per HTTP request (default: off; env MSTAR_ACCESS_LOG=1)")
    serve.add_argument("--version", action="version", version=version)
    _add_check(sub)
    return parser


def _add_models_flags(serve: argparse.ArgumentParser) -> None:
    """Several models behind one deployment (llama-server's router mode; docs/deploy.md)."""
    serve.add_argument("--models-dir", default=os.environ.get("MSTAR_MODELS_DIR") or None, metavar="DIR",
                       help="serve every model of DIR (each subfolder with a config.json, each .gguf file), named by "
                            "its folder or file name; with repeated --model, those too; requests pick one by their "
                            "`model` field (env MSTAR_MODELS_DIR; default: none)")
    serve.add_argument("--models-max", type=int, default=int(os.environ.get(MODELS_MAX_ENV) or 0),
                       help="several models: the most loaded at once; a request for another loads it on first use "
                            "and the least recently used model's gpu workers stop "
                            f"(env {MODELS_MAX_ENV}; default 0: every model stays loaded)")


def _add_media_flags(serve: argparse.ArgumentParser) -> None:
    """The api's image-input flags (services/api/__main__.py), passed on when given; the
    defaults are written out rather than imported, so the launcher loads none of the api."""
    serve.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                       help="the only hosts http(s) image URLs may name, space- or comma-separated "
                            "(env MSTAR_ALLOWED_MEDIA_DOMAINS; default: empty, any host)")
    serve.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                       help="a folder whose files file:// image URLs may name "
                            "(env MSTAR_ALLOWED_LOCAL_MEDIA_PATH; default: none, file:// URLs are refused)")
    serve.add_argument("--max-image-bytes", type=int, default=None,
                       help="largest image file; larger is a 400 (env MSTAR_MAX_IMAGE_BYTES; default 20 MiB)")
    serve.add_argument("--max-image-pixels", type=int, default=None,
                       help="most pixels an image may have (env MSTAR_MAX_IMAGE_PIXELS; default 36000000)")
    serve.add_argument("--max-images-per-request", type=int, default=None,
                       help="most images one request may carry (env MSTAR_MAX_IMAGES_PER_REQUEST; default 16)")
    serve.add_argument("--media-fetch-timeout", type=float, default=None, metavar="SECONDS",
                       help="seconds one http(s) image fetch may take (env MSTAR_MEDIA_FETCH_TIMEOUT_S; default 10)")


def _add_group_flags(serve: argparse.ArgumentParser) -> None:
    """Where a --tensor-parallel-size group's ranks meet (the gpu worker's flags,
    services/gpu_worker/__main__.py); one host needs none. Reach the workers by environment,
    --master-port as a port per worker (the next worker's group the next port)."""
    env = os.environ.get
    serve.add_argument("--master-addr", default=None,
                       help="host of each tensor-parallel group's rank 0 (env MSTAR_MASTER_ADDR; default 127.0.0.1)")
    serve.add_argument("--master-port", type=int, default=int(env("MSTAR_MASTER_PORT") or 0),
                       help="TCP port the first worker's group meets on, the next worker's the next port "
                            "(env MSTAR_MASTER_PORT; default: a free port per group, one host only)")
    serve.add_argument("--nnodes", type=int, default=None,
                       help="hosts a tensor-parallel group spreads over; the others run "
                            "`python -m services.gpu_worker --node-rank K` (env MSTAR_NNODES; default 1)")
    serve.add_argument("--node-rank", type=int, default=None,
                       help="this host's index among --nnodes (env MSTAR_NODE_RANK; default 0: rank 0 here)")


def _group_env(args: argparse.Namespace) -> None:
    for value, env in ((args.master_addr, "MSTAR_MASTER_ADDR"), (args.nnodes, "MSTAR_NNODES"),
                       (args.node_rank, "MSTAR_NODE_RANK")):
        if value is not None:
            os.environ[env] = str(value)
    os.environ.pop("MSTAR_MASTER_PORT", None)  # each worker gets its own by flag


def media_flags(args: argparse.Namespace) -> list[str]:
    """`mstar serve`'s image-input flags as the api's command line: only those given (the
    MSTAR_* variables reach the api through the environment); a local path made absolute."""
    flags: list[str] = []
    if args.allowed_media_domains:
        flags += ["--allowed-media-domains", ",".join(args.allowed_media_domains)]
    if args.allowed_local_media_path is not None:
        flags += ["--allowed-local-media-path", os.path.abspath(os.path.expanduser(args.allowed_local_media_path))]
    for flag, value in (("--max-image-bytes", args.max_image_bytes), ("--max-image-pixels", args.max_image_pixels),
                        ("--max-images-per-request", args.max_images_per_request),
                        ("--media-fetch-timeout", args.media_fetch_timeout)):
        if value is not None:
            flags += [flag, str(value)]
    return flags


def _add_check(sub) -> None:
    check = sub.add_parser("check", conflict_handler="resolve",
                           help="run the deployment check `serve` runs before any child starts, and exit: 0 when "
                                "the model and settings would be served, else 2 with the reason (compose runs it "
                                "once before the services, so a bad model stops instead of restarting)")
    check.add_argument("model", nargs="?", metavar="MODEL", default=None, action=_ModelAction, help=MODEL_HELP)
    add_deployment_flags(check)
    check.add_argument("--model", dest="model", default=None, action=_ModelAction, help=MODEL_FLAG_HELP)
    check.add_argument("--chat-template", default=os.environ.get("MSTAR_CHAT_TEMPLATE") or None,
                       help=CHAT_TEMPLATE_HELP)


def preflight(d: Deployment, chat_template: str | None) -> str | None:
    """What the conductor would refuse, checked here before any child starts: None when
    the deployment is fine, else the one-line reason.

    Checked in a forked child where the OS forks: the check imports the specs, numpy and
    the tokenizer library and reads the model's config, ~25 MiB the launcher would
    otherwise carry while it only supervises (a fork costs a millisecond, not a new
    interpreter)."""
    if not hasattr(os, "fork"):
        return _check(d, chat_template)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the verdict into the pipe, then out without cleanup handlers
        code = 0
        try:
            os.close(read)
            os.write(write, (_check(d, chat_template) or "").encode())
        except BaseException:  # shown here, then reported by the parent from the exit code
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        reason = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        return "the deployment check itself failed (its traceback is above)"
    return reason or None


def _check(d: Deployment, chat_template: str | None) -> str | None:
    from services.conductor.__main__ import validate_deployment
    from shared.specs.base import DeploymentError

    try:
        validate_deployment(d.model, d.page_size, d.max_seq_len, d.task)
        if d.tensor_parallel_size > 1:  # a model the ranks cannot share, named before any starts
            from services.gpu_worker.tp.main import refuse_unservable

            refuse_unservable(d)
        if chat_template:  # imported only then: the api's modules are ~0.1 s of every start
            from services.api.chat_template import read_template_file

            read_template_file(chat_template)
    except (DeploymentError, FileNotFoundError, ValueError, NotImplementedError) as exc:
        return " ".join(str(exc).split()) or type(exc).__name__
    return None


def model_name(model: str) -> str:
    """The name a model is served under, as `ModelSource` gives it (a folder's name, a
    .gguf's stem, a Hub id as is), without reading it."""
    path = os.path.expanduser(model)
    if os.path.exists(path) or path.endswith(".gguf"):
        base = os.path.basename(os.path.normpath(path))
        return base[: -len(".gguf")] if base.endswith(".gguf") else base
    return model


def served_models(args: argparse.Namespace) -> list[ServedModel]:
    """Every model `serve` was asked for: --models-dir's, then each --model; empty when
    one --model (or none) is given, the usual single-model deployment."""
    found = models_in_dir(args.models_dir) if getattr(args, "models_dir", None) else []
    given = getattr(args, "model_list", None) or []
    if not found and len(given) < 2:
        return []
    found += [ServedModel(model_name(m), os.path.abspath(os.path.expanduser(m)) if os.path.exists(
        os.path.expanduser(m)) else m) for m in given]
    check_names(found)
    return found


def say(text: str, level: str = "INFO") -> None:
    """One line of the launcher's own on stderr: as is, or under --log-format json as the
    services' JSON records are, so that the whole stream parses."""
    if os.environ.get("MSTAR_LOG_FORMAT") == "json":
        text = json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "level": level,
                           "service": "launcher", "pid": os.getpid(), "logger": "mstar.launcher", "message": text})
    print(text, file=sys.stderr, flush=True)


def _log_env(args: argparse.Namespace) -> None:
    """--log-level, --log-format and --access-log reach every child as its env vars."""
    for value, env in ((getattr(args, "log_level", None), "MSTAR_LOG_LEVEL"),
                       (getattr(args, "log_format", None), "MSTAR_LOG_FORMAT")):
        if value is not None:
            os.environ[env] = value
    if getattr(args, "access_log", None) is not None:
        os.environ["MSTAR_ACCESS_LOG"] = "1" if args.access_log else "0"
    if os.environ.get("MSTAR_LOG_FORMAT", "").lower() == "json":
        # a gated child imports its modules (tqdm among them, which reads TQDM_* once, at
        # import) before its own setup_logging could turn progress bars off for JSON lines
        os.environ.setdefault("TQDM_DISABLE", "1")


def _resolve(args: argparse.Namespace, d: Deployment) -> tuple[Deployment, list[ServedModel], str | None]:
    """(the deployment, the models when several are served, why it is refused or None) from
    the flags alone, without reading a model: what must hold before any child starts."""
    try:
        models = served_models(args) if args.command == "serve" else []
    except ValueError as exc:
        return d, [], str(exc)
    if len(models) == 1:  # a --models-dir of one: served as --model, named by its folder or file
        d = msgspec.structs.replace(d, model=models[0].model)
        if args.served_model_name is None:
            args.served_model_name = models[0].name
        models = []
    named = getattr(args, "served_model_name", None)
    if not models and named is not None and not named.strip():
        return d, [], "--served-model-name must be non-empty"
    if models and named is not None:
        return d, models, "--served-model-name names one model; several are served (each named by its folder or file)"
    return d, models, None


def _refusal(d: Deployment, models: list[ServedModel], chat_template: str | None) -> str | None:
    """Why the deployment check refuses it, or None: one model is checked as always;
    several each by the same check."""
    if not models:
        return preflight(d, chat_template)
    for m in models:
        refused = preflight(msgspec.structs.replace(d, model=m.model), chat_template)
        if refused is not None:
            return f"model {m.name}: {refused}"
    return None


def _api_flags(args: argparse.Namespace, chat_template: str | None) -> list[str]:
    """The api's command line from `serve`'s flags."""
    api_flags = ["--max-body-bytes", str(args.max_body_bytes)] if args.max_body_bytes else []
    if args.served_model_name is not None:
        api_flags += ["--served-model-name", args.served_model_name]
    if chat_template:
        api_flags += ["--chat-template", chat_template]
    if args.tool_call_parser != "auto":
        api_flags += ["--tool-call-parser", args.tool_call_parser]
    if args.generation_config not in ("auto", "vllm", "none"):  # a folder: as the api's cwd may differ
        api_flags += ["--generation-config", os.path.abspath(os.path.expanduser(args.generation_config))]
    elif args.generation_config != "auto":
        api_flags += ["--generation-config", args.generation_config]
    if args.enable_prompt_tokens_details:
        api_flags.append("--enable-prompt-tokens-details")
    return api_flags + media_flags(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _log_env(args)
    d = deployment_from_args(args)  # MODEL / --model, else --deployment, else MSTAR_MODEL
    chat_template = os.path.abspath(os.path.expanduser(args.chat_template)) if args.chat_template else None
    d, models, refused = _resolve(args, d)
    if args.command == "check":
        refused = refused or _refusal(d, models, chat_template)
        say(f"mstar: deployment refused: {refused}" if refused else f"mstar: deployment ok: {d.model or 'default'}",
            "ERROR" if refused else "INFO")
        return 2 if refused else 0
    if refused is not None:
        say(f"mstar: deployment refused: {refused}", "ERROR")
        return 2
    launcher = _plan(args, d, models, chat_template)
    launcher.start_gated()  # the children import (torch: most of a start) while the check runs
    try:
        refused = _refusal(d, models, chat_template)
    except BaseException:
        launcher.refuse()
        raise
    if refused is not None:
        launcher.refuse()
        say(f"mstar: deployment refused: {refused}", "ERROR")
        return 2
    return launcher.run()


def _plan(args: argparse.Namespace, d: Deployment, models: list[ServedModel], chat_template: str | None) -> Launcher:
    """The launcher and its children's command lines (nothing started yet)."""
    run_dir = tempfile.mkdtemp(prefix="mstar-")
    api_flags = _api_flags(args, chat_template)
    _group_env(args)
    if models:
        children = plan_fleet(d, run_dir, args.host, args.port, args.workers, api_flags, models, args.models_max)
    else:
        children = plan_children(d, run_dir, args.host, args.port, args.workers, api_flags, args.master_port)
    if args.api_key:
        os.environ["MSTAR_API_KEY"] = args.api_key
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    return Launcher(children, f"http://{host}:{args.port}/ready", run_dir, args.start_timeout)


if __name__ == "__main__":
    sys.exit(main())
