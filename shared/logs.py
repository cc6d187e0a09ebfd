"""One logging setup for every service, so lines from four processes interleave readably.

`--log-level` (env MSTAR_LOG_LEVEL, default INFO) and `--log-format` (env MSTAR_LOG_FORMAT):
`text`, one readable line per record, or `json`, one JSON object per line for a log
collector (Loki, Elasticsearch, Cloud Logging), with `time`, `level`, `service`, `pid`,
`logger`, `message`, `exc_info` on errors, and the request fields of an access-log line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
FORMATS = ("text", "json")
#: uvicorn's access-log record args, named (client, method, path, HTTP version, status)
ACCESS_FIELDS = ("client", "method", "path", "http_version", "status")


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": self.service,
            "pid": record.process,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(record.args) == 5:
            out.update(zip(ACCESS_FIELDS, record.args))
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def add_logging_flags(parser: argparse.ArgumentParser) -> None:
    level, fmt = os.environ.get("MSTAR_LOG_LEVEL") or "INFO", os.environ.get("MSTAR_LOG_FORMAT") or "text"
    parser.add_argument("--log-level", type=str.upper, choices=LEVELS, default=None,
                        help=f"least severe level logged (default: {level}; env MSTAR_LOG_LEVEL)")
    parser.add_argument("--log-format", choices=FORMATS, default=None,
                        help="text: one readable line per record; json: one JSON object per line "
                             f"(default: {fmt}; env MSTAR_LOG_FORMAT)")


def setup_logging(service: str, level: str | None = None, fmt: str | None = None) -> logging.Logger:
    """Configure the root logger once per process: `level` / `fmt` (the flags), else the
    env vars, else INFO and text."""
    level = (level or os.environ.get("MSTAR_LOG_LEVEL") or "INFO").upper()
    fmt = (fmt or os.environ.get("MSTAR_LOG_FORMAT") or "text").lower()
    if fmt not in FORMATS:
        raise SystemExit(f"MSTAR_LOG_FORMAT must be one of {FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(service))
        # progress bars (weight loading) would break the one-object-per-line stream; tqdm
        # reads its TQDM_* overrides when first imported, which comes after this
        os.environ.setdefault("TQDM_DISABLE", "1")
        logging.captureWarnings(True)  # Python warnings as records too, not bare text lines
    else:
        text = f"%(asctime)s %(levelname)s {service}[%(process)d] %(name)s: %(message)s"
        handler.setFormatter(logging.Formatter(text))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    return logging.getLogger(f"mstar.{service}")
