"""Image inputs: turn an `image_url` into the image file's bytes, or a 400 naming why not.

A chat content part `{"type": "image_url", "image_url": {"url": ...}}` may carry the image
inline (`data:image/<type>;base64,...`), point at it (`http://`, `https://`), or name a file
on the server (`file://`, only under `--allowed-local-media-path`, vLLM's flag). The api
fetches and checks it here, before anything is sent to the data worker, so a bad image is
the client's 400 with `param` naming the part (`messages[0].content[1].image_url.url`)
rather than a failure deep in a worker.

Every way in is bounded: bytes (`max_image_bytes`, enforced while reading, never after),
time (one deadline over a whole fetch, redirects included, so a server dripping bytes
cannot hold a request open), hosts (`allowed_media_domains`, checked on every redirect hop
before connecting), paths (symlinks resolved before the allowed-path check), and pixels
(`max_image_pixels`, read from the header: nothing is decoded here; the data worker
decodes). With no allowed domains any host is fetched, private addresses included (as
vLLM does): a server that takes untrusted clients should set `--allowed-media-domains`.

Pillow and httpx are imported where used: `python -m services.api --help` and the
settings (which import the defaults below) stay quick to load.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

from services.api.errors import ApiError, invalid

if TYPE_CHECKING:
    import httpx

#: 20 MiB: a large camera JPEG or a lossless screenshot; more is a 400 before it is all read
DEFAULT_MAX_IMAGE_BYTES = 20 << 20
#: 36 MP: 8K (7680x4320, 33.2 MP) and 24 MP camera photos fit; a decoded RGBA image stays
#: under 144 MB. Vision encoders resize to ~1-4 MP anyway, so more pixels buy the model
#: nothing and cost the data worker's memory and time (and are how decompression bombs
#: look: a small file declaring a huge canvas)
DEFAULT_MAX_IMAGE_PIXELS = 36_000_000
DEFAULT_FETCH_TIMEOUT_S = 10.0
DEFAULT_MAX_IMAGES_PER_REQUEST = 16
#: redirects followed per fetch (each hop's host is checked against the allowed domains)
MAX_REDIRECTS = 5
#: what the data worker decodes; anything else Pillow reads (TIFF, PSD, EPS, ...) is a 400
ALLOWED_FORMATS = ("BMP", "GIF", "JPEG", "PNG", "WEBP")


@dataclass(frozen=True)
class MediaPolicy:
    """What the api accepts as an image input (from `ApiSettings.media_policy()`)."""

    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S  # one deadline over a whole http(s) fetch
    #: hosts http(s) images may come from, exact match (lower case); empty: any host
    allowed_media_domains: tuple[str, ...] = ()
    #: the folder file:// images may come from (symlinks resolved); None: no local files
    allowed_local_media_path: str | None = None
    max_images_per_request: int = DEFAULT_MAX_IMAGES_PER_REQUEST

    def __post_init__(self) -> None:
        if min(self.max_image_bytes, self.max_image_pixels, self.max_images_per_request) < 1:
            raise ValueError("max_image_bytes, max_image_pixels and max_images_per_request must be >= 1")
        if not self.fetch_timeout_s > 0:
            raise ValueError(f"the media fetch timeout must be > 0, got {self.fetch_timeout_s}")
        if self.allowed_local_media_path == "":
            raise ValueError("allowed_local_media_path must be non-empty when given")
        domains = tuple(_host_key(d) for d in self.allowed_media_domains)
        if any(not d or "/" in d for d in domains):
            raise ValueError(f"allowed media domains are host names (no scheme or path): "
                             f"{self.allowed_media_domains}")
        object.__setattr__(self, "allowed_media_domains", domains)  # frozen: normalized once, here

    def check_image_count(self, n: int, param: str) -> None:
        """A 400 when one request carries more than `max_images_per_request` images: each
        is fetched and decoded, so the count bounds a request's work as the body size does."""
        if n > self.max_images_per_request:
            raise invalid(param, f"{n} images in one request; the limit is {self.max_images_per_request}")


def _host_key(host: str) -> str:
    """A host as compared with the allowed domains: lower case, no trailing dot."""
    return host.strip().lower().rstrip(".")


async def load_image(url: str, param: str, policy: MediaPolicy, client: httpx.AsyncClient | None = None) -> bytes:
    """The bytes of the image file `url` names, checked against `policy`; else an
    `ApiError` 400 whose `param` is `param` and whose message names the reason and limit.

    `client` lets a caller share one connection pool across requests; without it a client
    is made for this fetch and closed. The CPU work (base64, Pillow's header parse and
    `verify`, blocking file reads) runs in a thread so the event loop keeps serving other
    requests' tokens meanwhile (it shares the GIL, but is not blocked for a 20 MiB image).
    """
    scheme = url[:16].partition(":")[0].lower() if ":" in url[:16] else ""
    if scheme == "data":
        data = await asyncio.to_thread(_decode_data_url, url, param, policy)
    elif scheme in ("http", "https"):
        data = await _fetch_http(url, param, policy, client)
    elif scheme == "file":
        data = await asyncio.to_thread(_read_local_file, url, param, policy)
    else:
        local = " or file://" if policy.allowed_local_media_path else ""
        shown = f"URL scheme {scheme!r}" if scheme else "URL without a scheme"
        raise invalid(param, f"image {shown} is not supported; use data:image/<type>;base64,..., "
                             f"http:// or https://{local}")
    await asyncio.to_thread(check_image, data, param, policy)
    return data


def _too_large(param: str, limit: int, size: int | None = None) -> ApiError:
    has = f"has {size} bytes" if size is not None else "has more bytes than allowed"
    return invalid(param, f"the image {has}; the limit is {limit} bytes")


def _decode_data_url(url: str, param: str, policy: MediaPolicy) -> bytes:
    """`data:image/<type>;base64,<data>` -> the bytes; the size is checked from the base64
    length before decoding, so an oversized URL costs no decode (whitespace is allowed, as
    MIME wraps base64 lines)."""
    header, sep, payload = url[5:].partition(",")
    params = [p.strip().lower() for p in header.split(";")]
    if not sep or "base64" not in params[1:]:
        raise invalid(param, "a data URL must be data:image/<type>;base64,<base64 data>")
    if not params[0].startswith("image/"):
        raise invalid(param, f"the data URL's media type {params[0][:64]!r} is not an image type (image/*)")
    most = 4 * (policy.max_image_bytes // 3 + 2)  # the longest unwrapped base64 the cap allows
    if len(payload) > most + most // 16 + 1024:  # + room for line breaks (MIME: 2 per 76 chars)
        raise _too_large(param, policy.max_image_bytes)
    try:
        data = base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        raise invalid(param, "the data URL's data is not valid base64") from None
    if len(data) > policy.max_image_bytes:
        raise _too_large(param, policy.max_image_bytes, len(data))
    return data


def check_image(data: bytes, param: str, policy: MediaPolicy) -> None:
    """A 400 unless `data` is an image file of an allowed format with at most
    `max_image_pixels` pixels whose structure Pillow's `verify()` accepts.

    `Image.open` reads the header only and `verify()` walks the file (PNG chunk CRCs, ...)
    without decoding pixels, so this costs little memory whatever the file claims; it does
    not prove the pixel data complete (a truncated JPEG passes: the data worker's decode
    finds it). Pillow's own decompression-bomb guard (`Image.MAX_IMAGE_PIXELS`, a process
    global) raises before the size can be read when a header claims over twice its
    limit; that is a 400 here too, and the global is raised to our limit if below it so that
    Pillow never refuses what the policy allows."""
    from PIL import Image

    if Image.MAX_IMAGE_PIXELS is not None and policy.max_image_pixels > Image.MAX_IMAGE_PIXELS:
        Image.MAX_IMAGE_PIXELS = policy.max_image_pixels
    try:
        im = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        raise invalid(param, f"the image has more than {2 * (Image.MAX_IMAGE_PIXELS or 0)} pixels; "
                             f"the limit is {policy.max_image_pixels} pixels") from None
    except Exception:  # UnidentifiedImageError, or a malformed header a plugin chokes on
        raise invalid(param, "the data could not be decoded as an image") from None
    with im:
        if im.format not in ALLOWED_FORMATS:
            raise invalid(param, f"image format {im.format} is not supported; "
                                 f"supported: {', '.join(ALLOWED_FORMATS)}")
        width, height = im.size
        if width * height > policy.max_image_pixels:
            raise invalid(param, f"the image is {width}x{height} ({width * height} pixels); "
                                 f"the limit is {policy.max_image_pixels} pixels")
        try:
            im.verify()
        except Exception:
            raise invalid(param, f"the data could not be decoded as an image (a broken {im.format} file)") from None


async def _fetch_http(url: str, param: str, policy: MediaPolicy, client: httpx.AsyncClient | None) -> bytes:
    """GET `url` (following at most MAX_REDIRECTS redirects) within one deadline of
    `fetch_timeout_s`: httpx's own timeout is per read, so a server sending a byte a
    second would never trip it; `asyncio.timeout` bounds the whole fetch."""
    import httpx

    own = client is None
    http = client if client is not None else httpx.AsyncClient(timeout=policy.fetch_timeout_s)
    try:
        async with asyncio.timeout(policy.fetch_timeout_s):
            return await _follow(http, url, param, policy)
    except (TimeoutError, httpx.TimeoutException):
        raise invalid(param, f"fetching the image timed out after {policy.fetch_timeout_s:g} s") from None
    finally:
        if own:
            await http.aclose()


async def _follow(client: httpx.AsyncClient, url: str, param: str, policy: MediaPolicy) -> bytes:
    """One hop per redirect, each URL checked (scheme, allowed host) before connecting."""
    import httpx

    for hop in range(MAX_REDIRECTS + 1):
        target = _checked_url(url, param, policy, redirected=hop > 0)
        try:
            async with client.stream("GET", target, follow_redirects=False, timeout=policy.fetch_timeout_s,
                                     headers={"Accept": "image/*", "Accept-Encoding": "identity"}) as resp:
                if resp.is_redirect:
                    url = _redirect_target(target, resp.headers["location"], param)
                    continue
                _check_response(resp, param, policy)
                return await _read_capped(resp, param, policy.max_image_bytes)
        except httpx.TimeoutException:
            raise  # the caller words it, with the deadline's
        except httpx.HTTPError as exc:
            raise invalid(param, f"fetching the image from {target.host} failed: {_reason(exc)}") from None
    raise invalid(param, f"fetching the image failed: more than {MAX_REDIRECTS} redirects")


def _redirect_target(current: httpx.URL, location: str, param: str) -> str:
    """A redirect's Location (relative to the URL that answered) as an absolute URL."""
    import httpx

    try:
        return str(current.join(location))
    except (httpx.InvalidURL, ValueError):
        raise invalid(param, "fetching the image failed: a redirect to an invalid URL") from None


def _checked_url(url: str, param: str, policy: MediaPolicy, redirected: bool) -> httpx.URL:
    """`url` parsed by httpx (the parser that connects, so `http://a@b/` is host b), if it
    is http(s) with a host that the allowed domains admit; else a 400."""
    import httpx

    via = "a redirect to " if redirected else ""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError):
        raise invalid(param, f"{via}the image URL is not a valid URL") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise invalid(param, f"{via}the image URL must be http:// or https:// with a host")
    host = _host_key(parsed.host)
    if policy.allowed_media_domains and host not in policy.allowed_media_domains:
        raise invalid(param, f"{via}host {host!r} is not one of the allowed media domains "
                             f"({', '.join(policy.allowed_media_domains)})")
    return parsed


def _check_response(resp: httpx.Response, param: str, policy: MediaPolicy) -> None:
    """A 400 for a non-2xx status, a body that is not image/*, a compressed body (asked
    for identity: a gzip stream could inflate far past the cap from one read) or a declared
    length over the cap (refused before reading any of the body)."""
    import httpx

    if not resp.is_success:
        phrase = httpx.codes.get_reason_phrase(resp.status_code)  # not the server's own text
        raise invalid(param, f"fetching the image failed: the server answered HTTP {resp.status_code} {phrase}")
    media_type = resp.headers.get("content-type", "").partition(";")[0].strip().lower()
    if not media_type.startswith("image/"):
        raise invalid(param, f"the URL's content type is {media_type[:64] or 'missing'!r}, not an image (image/*)")
    encoding = resp.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise invalid(param, f"the image was sent with Content-Encoding {encoding[:32]!r}; only identity is accepted")
    declared = resp.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > policy.max_image_bytes:
        raise _too_large(param, policy.max_image_bytes, int(declared))


async def _read_capped(resp: httpx.Response, param: str, limit: int) -> bytes:
    """The body, read until it passes `limit` at most (one network read past it, ~64 KiB);
    leaving the stream then closes the connection, so the rest is never received."""
    body = bytearray()
    async for chunk in resp.aiter_raw():
        body += chunk
        if len(body) > limit:
            raise _too_large(param, limit)
    return bytes(body)


def _reason(exc: httpx.HTTPError) -> str:
    """A client-safe phrase for a transport failure (no addresses, no library internals)."""
    import httpx

    if isinstance(exc, httpx.ConnectError):
        return "could not connect"
    if isinstance(exc, httpx.RemoteProtocolError):
        return "the server broke the HTTP protocol"
    if isinstance(exc, (httpx.ReadError, httpx.WriteError)):
        return "the connection broke"
    if isinstance(exc, httpx.TooManyRedirects):
        return "too many redirects"
    return type(exc).__name__


def _read_local_file(url: str, param: str, policy: MediaPolicy) -> bytes:
    """A file:// URL's bytes, when the path (symlinks resolved) lies under the allowed
    folder. The outside check comes before any existence check, so a client cannot probe
    which files exist elsewhere; a FIFO or device is refused (opened non-blocking)."""
    if policy.allowed_local_media_path is None:
        raise invalid(param, "local files (file:// URLs) are not allowed on this server")
    parts = urlsplit(url)
    path = Path(unquote(parts.path))
    if parts.netloc not in ("", "localhost") or not path.is_absolute():
        raise invalid(param, "a file:// URL must name an absolute local path (file:///path/to/image)")
    try:
        real = path.resolve()
        inside = real.is_relative_to(Path(policy.allowed_local_media_path).resolve())
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a NUL in the path
        raise invalid(param, "the local file cannot be read") from None
    if not inside:
        raise invalid(param, "the local file is outside the allowed media path")
    return _read_regular_file(real, param, policy.max_image_bytes)


def _read_regular_file(path: Path, param: str, limit: int) -> bytes:
    """At most `limit` + 1 bytes of a regular file (the extra one tells "too large")."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise invalid(param, "the local file does not exist") from None
    except (OSError, ValueError):
        raise invalid(param, "the local file cannot be read") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise invalid(param, "the local path is not a regular file")
        if info.st_size > limit:
            raise _too_large(param, limit, info.st_size)
        data = b""
        while len(data) <= limit:  # one read may return less (a read stops at ~2 GiB)
            more = os.read(fd, limit + 1 - len(data))
            if not more:
                break
            data += more
    except OSError:
        raise invalid(param, "the local file cannot be read") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise _too_large(param, limit)
    return data
