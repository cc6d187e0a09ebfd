"""Optional CURVE encryption and authentication of the services' tcp sockets.

Across hosts the ZMQ traffic (prompts, token ids, tensors) crosses the network: with a
cluster key set, every tcp socket is encrypted (CurveZMQ) and a bound socket accepts only
peers that hold the same key. One key pair serves the whole deployment, as one Secret:

- `MSTAR_CURVE_SECRET_KEY`: the Z85 secret key (40 characters), or
- `MSTAR_CURVE_SECRET_KEY_FILE`: a file holding it, either the bare key or a ZMQ
  certificate (`zmq.auth.create_certificates` writes `*.key_secret` files in that form).

Every service derives the public key from the secret: a bound socket is the CURVE server
with that pair, and its ZAP handler admits a client only if the client's public key is the
cluster's; a connecting socket is a CURVE client that expects the cluster's public key from
the server. A peer without the key (no CURVE at all, or another key) fails the handshake
and never delivers a frame. ipc sockets (one host, file permissions) stay plain.
`python -m shared.curve` prints a new secret key.
"""

from __future__ import annotations

import functools
import logging
import os
import threading

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger("mstar.curve")

SECRET_ENV = "MSTAR_CURVE_SECRET_KEY"
SECRET_FILE_ENV = "MSTAR_CURVE_SECRET_KEY_FILE"
ZAP_DOMAIN = "mstar"

_authenticators: dict[int, ThreadAuthenticator] = {}
_lock = threading.Lock()


@functools.cache
def _keys(secret: str | None, path: str | None) -> tuple[bytes, bytes] | None:
    if path:
        try:
            text = open(path).read()
        except OSError as exc:
            raise SystemExit(f"{SECRET_FILE_ENV}={path}: {exc.strerror}") from None
        if "secret-key" in text:
            key = zmq.auth.load_certificate(path)[1]
            if key is None:  # "secret-key" only in a comment: a public certificate
                raise SystemExit(f"{SECRET_FILE_ENV}={path}: a ZMQ certificate without a secret-key")
            secret = key.decode()
        else:
            secret = text.strip()
    if not secret:
        return None
    secret = secret.strip()
    try:
        public = zmq.curve_public(secret.encode())
    except (ValueError, zmq.ZMQError):
        raise SystemExit(f"{SECRET_ENV} / {SECRET_FILE_ENV}: not a Z85 CURVE secret key "
                         f"(40 characters; `python -m shared.curve` makes one)") from None
    return public, secret.encode()


def cluster_keys() -> tuple[bytes, bytes] | None:
    """(public, secret) Z85 keys of the deployment, or None when CURVE is off."""
    return _keys(os.environ.get(SECRET_ENV) or None, os.environ.get(SECRET_FILE_ENV) or None)


class _ClusterPeers:
    """ZAP credentials: a client is admitted only with the cluster's public key."""

    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        if key == self.public:
            return True
        log.warning("refused a tcp peer whose CURVE key %s is not this deployment's", key.decode(errors="replace"))
        return False


def _authenticate(ctx: zmq.Context, public: bytes) -> None:
    """One ZAP handler per libzmq context, started with the first CURVE server socket."""
    with _lock:
        if ctx.underlying in _authenticators:
            return
        auth = ThreadAuthenticator(ctx, log=logging.getLogger("mstar.curve.zap"))
        auth.start()
        auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_ClusterPeers(public))
        _authenticators[ctx.underlying] = auth
    log.info("CURVE on: tcp sockets are encrypted and admit only peers holding the cluster key")


def stop(ctx: zmq.Context) -> None:
    """Stop the context's ZAP handler (before `ctx.term()`, which would wait on it)."""
    with _lock:
        auth = _authenticators.pop(ctx.underlying, None)
    if auth is not None:
        auth.stop()


def secure_server(sock: zmq.Socket, address: str) -> None:
    """Before `sock.bind(address)`: on tcp with a cluster key, a CURVE server that admits
    only the cluster's key."""
    keys = cluster_keys()
    if keys is None or not address.startswith("tcp://"):
        return
    public, secret = keys
    _authenticate(sock.context, public)
    sock.zap_domain = ZAP_DOMAIN.encode()
    sock.curve_secretkey, sock.curve_publickey = secret, public
    sock.curve_server = True


def secure_client(sock: zmq.Socket, address: str) -> None:
    """Before `sock.connect(address)`: on tcp with a cluster key, a CURVE client holding it."""
    keys = cluster_keys()
    if keys is None or not address.startswith("tcp://"):
        return
    public, secret = keys
    sock.curve_secretkey, sock.curve_publickey = secret, public
    sock.curve_serverkey = public


if __name__ == "__main__":
    print(zmq.curve_keypair()[1].decode())
