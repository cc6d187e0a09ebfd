"""services/api/media.py: image URLs (data, http(s), file) to checked image bytes, or a
400 naming the request field and the reason. The http cases run against a real HTTP server
on 127.0.0.1 (a thread), so redirects, status codes, slow and oversized bodies are real."""

from __future__ import annotations

import base64
import http.server
import io
import os
import socket
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from PIL import Image

from services.api.errors import ApiError
from services.api.media import MAX_REDIRECTS, MediaPolicy, check_image, load_image
from services.api.settings import ApiSettings, media_from_env, settings_from_env, split_domains

PARAM = "messages[0].content[1].image_url.url"
POLICY = MediaPolicy()


def image_bytes(fmt: str, size: tuple[int, int] = (8, 6)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (200, 30, 40)).save(buf, fmt)
    return buf.getvalue()


PNG = image_bytes("PNG")
JPEG = image_bytes("JPEG")


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares a width x height canvas and holds no pixels: a decompression
    bomb's header, made without allocating the canvas."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


async def refused(url: str, policy: MediaPolicy = POLICY, client: httpx.AsyncClient | None = None) -> ApiError:
    """The ApiError `load_image` raises, checked to be the client's 400 for PARAM."""
    with pytest.raises(ApiError) as info:
        await load_image(url, PARAM, policy, client)
    err = info.value
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", PARAM), err
    return err


def has(err: ApiError, *words: str) -> None:
    for word in words:
        assert word in err.message, (word, err.message)


# --- data URLs --------------------------------------------------------------------------------


async def test_data_url_png_and_jpeg_come_back_as_the_file():
    assert await load_image(data_url(PNG), PARAM, POLICY) == PNG
    assert await load_image(data_url(JPEG, "image/jpeg"), PARAM, POLICY) == JPEG
    wrapped = data_url(PNG)[:40] + "\n" + data_url(PNG)[40:]  # MIME-style line breaks are fine
    assert await load_image(wrapped, PARAM, POLICY) == PNG


async def test_data_url_refusals():
    has(await refused("data:image/png;base64,@@not base64@@"), "not valid base64")
    has(await refused("data:text/plain;base64,aGVsbG8="), "'text/plain'", "not an image type")
    has(await refused("data:image/png,rawbytes"), "data:image/<type>;base64")
    has(await refused(data_url(b"hello, this is text")), "could not be decoded as an image")
    has(await refused(data_url(image_bytes("TIFF"), "image/tiff")), "TIFF", "not supported", "PNG")
    has(await refused(data_url(PNG[:40] + b"\0" * 20)), "could not be decoded as an image")


async def test_data_url_over_the_byte_limit():
    small = MediaPolicy(max_image_bytes=len(PNG) - 1)
    has(await refused(data_url(PNG), small), f"has {len(PNG)} bytes", f"limit is {len(PNG) - 1} bytes")
    tiny = MediaPolicy(max_image_bytes=10)  # refused from the base64 length, before decoding
    has(await refused(data_url(image_bytes("PNG", (300, 300))), tiny), "limit is 10 bytes")


async def test_too_many_pixels_names_the_size_and_the_limit():
    policy = MediaPolicy(max_image_pixels=40 * 30 - 1)
    has(await refused(data_url(image_bytes("PNG", (40, 30))), policy), "40x30", "1200 pixels", "limit is 1199 pixels")
    assert await load_image(data_url(image_bytes("PNG", (40, 30))), PARAM, MediaPolicy(max_image_pixels=1200))


async def test_a_decompression_bomb_header_is_refused_without_decoding():
    # 100k x 100k declared in 57 bytes: past Pillow's own bomb limit, refused from the header
    has(await refused(data_url(png_header_only(100_000, 100_000))), "pixels", "limit is 36000000 pixels")
    # under Pillow's limit but over ours: our check, with the size
    has(await refused(data_url(png_header_only(7000, 7000))), "7000x7000", "limit is 36000000 pixels")


def test_check_image_alone_accepts_every_allowed_format():
    for fmt in ("PNG", "JPEG", "WEBP", "GIF", "BMP"):
        check_image(image_bytes(fmt), PARAM, POLICY)


async def test_other_schemes_are_refused():
    has(await refused("ftp://example.com/a.png"), "'ftp'", "not supported")
    has(await refused("example.com/a.png"), "without a scheme", "not supported")


def test_image_count():
    POLICY.check_image_count(16, PARAM)
    with pytest.raises(ApiError) as info:
        POLICY.check_image_count(17, "messages")
    assert (info.value.status, info.value.param) == (400, "messages")
    assert "17 images" in info.value.message and "limit is 16" in info.value.message


# --- http(s) ------------------------------------------------------------------------------------

BIG_STREAM = 64 << 20  # what /big-stream would send if the client read it all


@dataclass
class Server:
    """What the handler saw, for the tests to check (bytes sent, when each handler ended)."""

    port: int
    release: threading.Event = field(default_factory=threading.Event)  # ends /slow and /drip
    sent: dict[str, int] = field(default_factory=dict)
    done: dict[str, threading.Event] = field(default_factory=dict)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"


def _handler(state: Server) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # quiet
            pass

        def reply(self, status: int, body: bytes, ctype: str, length: bool = True, **headers: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            if length:
                self.send_header("Content-Length", str(len(body)))
            for k, v in headers.items():
                self.send_header(k.replace("_", "-"), v)
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            done = state.done.setdefault(self.path, threading.Event())
            try:
                self.route()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client went away: what the size cap and the deadline do
            finally:
                done.set()

        def route(self) -> None:
            p = self.path
            if p == "/img.png":
                self.reply(200, PNG, "image/png")
            elif p == "/missing":
                self.reply(404, b"nope", "text/plain")
            elif p == "/page":
                self.reply(200, b"<html>hi</html>", "text/html; charset=utf-8")
            elif p == "/gzip":
                self.reply(200, zlib.compress(PNG), "image/png", Content_Encoding="gzip")
            elif p == "/big-declared":
                self.reply(200, b"x" * 4096, "image/png")  # over the tests' 1 KiB cap by its header
            elif p == "/big-stream":
                self.stream_big()
            elif p in ("/slow", "/drip"):
                self.slow(drip=p == "/drip")
            elif p == "/to-img":
                self.reply(302, b"", "text/plain", Location="/img.png")
            elif p == "/to-localhost":
                self.reply(302, b"", "text/plain", Location=state.url("/img.png", host="localhost"))
            elif p == "/to-file":
                self.reply(302, b"", "text/plain", Location="file:///etc/passwd")
            elif p == "/loop":
                self.reply(302, b"", "text/plain", Location="/loop")

        def stream_big(self) -> None:
            """No Content-Length (the body ends at close): only reading stops it."""
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            chunk = b"\0" * 65536
            state.sent[self.path] = 0
            while state.sent[self.path] < BIG_STREAM:
                self.wfile.write(chunk)
                state.sent[self.path] += len(chunk)

        def slow(self, drip: bool) -> None:
            if not drip:
                state.release.wait(5)  # headers only once the test is over
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            while not state.release.wait(0.02):  # a byte every 20 ms: no single read times out
                self.wfile.write(b"\0")
                self.wfile.flush()

    return Handler


@pytest.fixture
def server() -> Iterator[Server]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    state = Server(port=httpd.server_address[1])
    httpd.RequestHandlerClass = _handler(state)
    httpd.block_on_close = True
    httpd.daemon_threads = False  # server_close() joins every handler thread
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        state.release.set()
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)
        assert not thread.is_alive()


LOCAL = MediaPolicy(allowed_media_domains=("127.0.0.1",))


async def test_http_png_is_fetched(server):
    assert await load_image(server.url("/img.png"), PARAM, POLICY) == PNG
    assert await load_image(server.url("/img.png"), PARAM, LOCAL) == PNG
    assert await load_image(server.url("/to-img"), PARAM, LOCAL) == PNG  # a redirect on an allowed host
    async with httpx.AsyncClient() as client:  # a caller's client is used, and left open
        assert await load_image(server.url("/img.png"), PARAM, POLICY, client) == PNG
        assert not client.is_closed


async def test_http_refusals(server):
    has(await refused(server.url("/missing")), "HTTP 404 Not Found")
    has(await refused(server.url("/page")), "'text/html'", "not an image")
    has(await refused(server.url("/gzip")), "Content-Encoding 'gzip'")
    has(await refused(server.url("/loop")), f"more than {MAX_REDIRECTS} redirects")
    has(await refused(server.url("/to-file")), "a redirect to", "http:// or https://")


async def test_a_declared_length_over_the_cap_is_refused_from_the_header(server):
    has(await refused(server.url("/big-declared"), MediaPolicy(max_image_bytes=1024)),
        "has 4096 bytes", "limit is 1024 bytes")


async def test_an_endless_body_stops_at_the_cap(server):
    start = time.monotonic()
    has(await refused(server.url("/big-stream"), MediaPolicy(max_image_bytes=100_000)), "more bytes than allowed",
        "limit is 100000 bytes")
    assert time.monotonic() - start < 2
    assert server.done["/big-stream"].wait(5)  # the server's next write failed: the client hung up
    assert server.sent["/big-stream"] < BIG_STREAM  # the rest was never read (only socket buffers filled)


async def test_slow_servers_time_out(server):
    quick = MediaPolicy(fetch_timeout_s=0.3)
    start = time.monotonic()
    has(await refused(server.url("/slow"), quick), "timed out after 0.3 s")
    # a byte every 20 ms never trips a per-read timeout; the fetch's one deadline does
    has(await refused(server.url("/drip"), quick), "timed out after 0.3 s")
    assert time.monotonic() - start < 2


async def test_a_redirect_to_a_host_not_allowed_is_refused(server):
    has(await refused(server.url("/to-localhost"), LOCAL), "a redirect to", "'localhost'", "allowed media domains")
    assert "/img.png" not in server.done  # never fetched from localhost


async def test_connection_refused_names_the_reason():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    has(await refused(f"http://127.0.0.1:{port}/a.png"), "from 127.0.0.1 failed", "could not connect")


async def test_allowed_domains_refuse_other_hosts_before_connecting():
    def no_network(request: httpx.Request) -> httpx.Response:
        raise AssertionError(f"connected to {request.url}")

    policy = MediaPolicy(allowed_media_domains=("Images.Example.com",))
    async with httpx.AsyncClient(transport=httpx.MockTransport(no_network)) as client:
        for url in ("https://example.com/a.png", "http://images.example.com.evil.net/a.png",
                    "http://images.example.com@evil.net/a.png"):  # userinfo: the host is evil.net
            has(await refused(url, policy, client), "is not one of the allowed media domains", "images.example.com")


# --- file:// -------------------------------------------------------------------------------------


@pytest.fixture
def files(tmp_path: Path) -> Path:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "img.png").write_bytes(PNG)
    (allowed / "my pic.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")
    os.mkfifo(allowed / "fifo.png")
    return allowed


async def test_local_files_only_under_the_allowed_path(files: Path):
    policy = MediaPolicy(allowed_local_media_path=str(files))
    assert await load_image(f"file://{files}/img.png", PARAM, policy) == PNG
    assert await load_image(f"file://{files}/my%20pic.png", PARAM, policy) == PNG
    has(await refused(f"file://{files}/img.png"), "local files", "not allowed")
    has(await refused(f"file://{files}/../secret.png", policy), "outside the allowed media path")
    has(await refused(f"file://{files}/link.png", policy), "outside the allowed media path")
    has(await refused(f"file://{files}/../nothing-here.png", policy), "outside the allowed media path")
    has(await refused(f"file://{files}/nothing-here.png", policy), "does not exist")
    has(await refused(f"file://{files}/fifo.png", policy), "not a regular file")
    has(await refused(f"file://{files}", policy), "not a regular file")
    has(await refused(f"file://otherhost{files}/img.png", policy), "absolute local path")
    has(await refused(f"file://{files}/img.png", MediaPolicy(allowed_local_media_path=str(files),
                                                             max_image_bytes=len(PNG) - 1)),
        f"limit is {len(PNG) - 1} bytes")


# --- settings and flags ----------------------------------------------------------------------------


def test_settings_env_and_flags(monkeypatch):
    assert split_domains("a.com, b.com c.com") == ("a.com", "b.com", "c.com")
    assert split_domains(["a.com,b.com", "c.com"]) == ("a.com", "b.com", "c.com")
    monkeypatch.setenv("MSTAR_ALLOWED_MEDIA_DOMAINS", "A.com,b.com")
    monkeypatch.setenv("MSTAR_MAX_IMAGE_BYTES", "1000")
    monkeypatch.setenv("MSTAR_MEDIA_FETCH_TIMEOUT_S", "2.5")
    assert media_from_env() == {"allowed_media_domains": ("A.com", "b.com"), "max_image_bytes": 1000,
                                "media_fetch_timeout_s": 2.5}
    policy = settings_from_env("m").media_policy()
    assert policy == MediaPolicy(max_image_bytes=1000, fetch_timeout_s=2.5, allowed_media_domains=("a.com", "b.com"))
    with pytest.raises(ValueError):
        settings_from_env("m", max_image_bytes=0)
    with pytest.raises(ValueError):
        ApiSettings(model_name="m", api_addr="a", advertise_addr="a", data_worker_addr="d", conductor_addr="c",
                    control_addr="c", allowed_media_domains=("https://a.com/",))


def test_api_flags_and_their_passage_through_mstar_serve(tmp_path):
    from services.api.__main__ import build_parser, media_settings
    from services.launcher import build_parser as serve_parser
    from services.launcher import media_flags

    argv = ["serve", "--allowed-media-domains", "a.com", "b.com,c.com", "--allowed-local-media-path", str(tmp_path),
            "--max-image-bytes", "5000", "--media-fetch-timeout", "3"]
    passed = media_flags(serve_parser().parse_args(argv))
    assert passed == ["--allowed-media-domains", "a.com,b.com,c.com", "--allowed-local-media-path", str(tmp_path),
                      "--max-image-bytes", "5000", "--media-fetch-timeout", "3.0"]
    got = media_settings(build_parser().parse_args(passed))
    assert got["allowed_media_domains"] == ("a.com", "b.com", "c.com")
    assert (got["allowed_local_media_path"], got["max_image_bytes"], got["media_fetch_timeout_s"]) == (
        str(tmp_path), 5000, 3.0)
    assert media_flags(serve_parser().parse_args(["serve"])) == []
    with pytest.raises(ValueError, match="not a folder"):
        media_settings(build_parser().parse_args(["--allowed-local-media-path", str(tmp_path / "none")]))
