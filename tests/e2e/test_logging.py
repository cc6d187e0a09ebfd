"""`mstar serve --log-format json --access-log`: every service logs one JSON object per line
(the service named in each), and the api adds one access line per HTTP request, with the
request's method, path and status as fields. Without --access-log there is none."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from shared.logs import JsonFormatter, setup_logging
from tests.servers import MstarServer


@pytest.fixture(autouse=True)
def restore_root_logger():
    """setup_logging configures this process's root logger (a handler on the test's
    captured stderr, DEBUG): put it back, or every later test's log records (httpx logs
    each request at INFO) go to a closed stream, each with a traceback."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.captureWarnings(False)


def test_json_logs_and_access_log_through_the_launcher(llama_ckpt, tmp_path):
    server = MstarServer(str(llama_ckpt), tmp_path / "log.txt", "--num-kv-pages", "32",
                         "--log-format", "json", "--access-log").start()
    try:
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        r = httpx.post(server.url + "/generate", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
    finally:
        server.stop()
    records = [json.loads(line) for line in server.log().splitlines() if line.strip()]  # every line parses
    services = {r["service"].split(":")[0] for r in records}
    assert {"launcher", "api", "conductor", "data_worker", "gpu_worker"} <= services
    assert any(r["message"].startswith("mstar: ready on") for r in records if r["service"] == "launcher")
    access = [r for r in records if r["logger"] == "uvicorn.access"]
    assert {(a["method"], a["path"], a["status"]) for a in access} >= {("GET", "/health", 200),
                                                                       ("POST", "/generate", 200)}
    assert all({"time", "level", "pid", "message"} <= r.keys() for r in records)


def test_text_format_and_no_access_log_by_default(capsys):
    log = setup_logging("unit", "DEBUG", "text")
    log.debug("hello %d", 1)
    logging.getLogger("uvicorn.access").info('%s - "%s %s HTTP/%s" %d', "1.2.3.4:5", "GET", "/x", "1.1", 404)
    err = capsys.readouterr().err
    assert "DEBUG unit[" in err and "hello 1" in err
    record = logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                               ("1.2.3.4:5", "GET", "/x", "1.1", 404), None)
    out = json.loads(JsonFormatter("api").format(record))
    assert out["message"] == '1.2.3.4:5 - "GET /x HTTP/1.1" 404' and out["status"] == 404 and out["service"] == "api"
    setup_logging("unit", "INFO", "text")
