"""CURVE on tcp, through a real conductor process started with a cluster key: a peer with no
key or with another key never gets a frame through (its WorkerReady is never seen, its
status query never answered; the other key is logged as refused), a peer holding the key
is heard. ipc sockets stay plain."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import msgspec
import zmq

from shared import curve
from shared.frames import ClusterStatus, FrameCodec, StatusQuery, WorkerReady
from tests.servers import REPO, free_port, service_env

CONDUCTOR_FRAMES = FrameCodec(ClusterStatus)


def _client(ctx: zmq.Context, kind: int, address: str, keys: tuple[bytes, bytes] | None,
            server_public: bytes) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.linger = 0
    if keys is not None:
        sock.curve_publickey, sock.curve_secretkey = keys
        sock.curve_serverkey = server_public
    sock.connect(address)
    return sock


def _status(sock: zmq.Socket, timeout_ms: int) -> ClusterStatus | None:
    sock.send_multipart(CONDUCTOR_FRAMES.encode(StatusQuery()))
    if not sock.poll(timeout_ms):
        return None
    return msgspec.msgpack.decode(sock.recv_multipart()[-1], type=ClusterStatus)


def test_conductor_refuses_peers_without_the_cluster_key(llama_ckpt, tmp_path):
    public, secret = zmq.curve_keypair()
    key_file = tmp_path / "cluster.key"
    key_file.write_text(secret.decode() + "\n")
    intake, control = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    log = open(tmp_path / "conductor.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "services.conductor", "--model", str(llama_ckpt),
                             "--conductor-addr", intake, "--conductor-control-addr", control],
                            cwd=REPO, env=service_env(MSTAR_CURVE_SECRET_KEY_FILE=str(key_file)),
                            stdout=log, stderr=subprocess.STDOUT)
    ctx = zmq.Context()
    codec = FrameCodec(WorkerReady)
    try:
        deadline = time.monotonic() + 60
        while b"listening on" not in (tmp_path / "conductor.log").read_bytes():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "conductor.log").read_text()
            time.sleep(0.1)
        other = zmq.curve_keypair()
        peers = {"plain": None, "other-key": other, "cluster-key": (public, secret)}
        for name, keys in peers.items():
            push = _client(ctx, zmq.PUSH, intake, keys, public)
            push.send_multipart(codec.encode(WorkerReady(name, f"tcp://127.0.0.1:{free_port()}", [], name)))
        # the keyed peer is heard (and refused for its missing fingerprint: it is no worker)
        while "worker cluster-key at" not in (tmp_path / "conductor.log").read_text():
            assert time.monotonic() < deadline, (tmp_path / "conductor.log").read_text()
            time.sleep(0.1)
        assert _status(_client(ctx, zmq.DEALER, control, (public, secret), public), 10_000) is not None
        assert _status(_client(ctx, zmq.DEALER, control, None, public), 1000) is None
        assert _status(_client(ctx, zmq.DEALER, control, other, public), 1000) is None
        text = (tmp_path / "conductor.log").read_text()
        assert "worker plain" not in text and "worker other-key" not in text
        assert f"refused a tcp peer whose CURVE key {other[0].decode()}" in text
        # and it stops on SIGTERM: its ZAP handler's socket once held the exit for good
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        ctx.destroy(linger=0)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_ipc_stays_plain_and_tcp_is_curve(monkeypatch, tmp_path):
    _, secret = zmq.curve_keypair()
    monkeypatch.setenv(curve.SECRET_ENV, secret.decode())
    ctx = zmq.Context()
    try:
        ipc, tcp, client = ctx.socket(zmq.PULL), ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        curve.secure_server(ipc, f"ipc://{tmp_path}/x.sock")
        curve.secure_server(tcp, "tcp://127.0.0.1:0")
        curve.secure_client(client, "tcp://127.0.0.1:1")
        assert ipc.mechanism == zmq.NULL and tcp.mechanism == zmq.CURVE and tcp.curve_server
        assert client.mechanism == zmq.CURVE and not client.curve_server
    finally:
        curve.stop(ctx)
        ctx.destroy(linger=0)
    monkeypatch.setenv(curve.SECRET_ENV, "not a key")
    try:
        curve.cluster_keys()
        raise AssertionError("a malformed key was accepted")
    except SystemExit as exc:
        assert "not a Z85 CURVE secret key" in str(exc)
