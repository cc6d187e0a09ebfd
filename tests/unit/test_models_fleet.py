"""Several models behind one deployment, the parts that need no process: a models folder
read into named models, the launcher's plan (each child's command line parsed by that
service's own parser), and /metrics merged across the models' registries."""

from __future__ import annotations

import importlib
import json

import pytest

from services.api.fleet import merge_metrics
from services.launcher import build_parser, plan_fleet, served_models
from shared.config import Deployment, deployment_from_args
from shared.models import ServedModel, check_names, decode_models, encode_models, models_in_dir


def test_models_dir_names_each_folder_and_gguf_file(tmp_path):
    for name in ("b-chat", "a-embed"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    (tmp_path / "tiny.gguf").write_bytes(b"GGUF")
    (tmp_path / "no-config").mkdir()  # not a model
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    got = models_in_dir(str(tmp_path))
    assert [m.name for m in got] == ["a-embed", "b-chat", "tiny"]
    assert got[2].model == str((tmp_path / "tiny.gguf").resolve())
    with pytest.raises(ValueError, match="no model in it"):
        models_in_dir(str(tmp_path / "no-config"))


def test_names_must_be_unique():
    with pytest.raises(ValueError, match="two models are named 'x'"):
        check_names([ServedModel("x", "/a"), ServedModel("x", "/b")])
    models = [ServedModel("x", "/a", "ipc://dw", "ipc://api")]
    assert decode_models(encode_models(models)) == models


def test_repeated_model_and_models_dir(tmp_path):
    (tmp_path / "chat").mkdir()
    (tmp_path / "chat" / "config.json").write_text("{}")
    parser = build_parser()
    assert served_models(parser.parse_args(["serve", "--model", "/x/one"])) == []  # one model: as always
    got = served_models(parser.parse_args(["serve", "--models-dir", str(tmp_path), "--model", "/x/m.gguf"]))
    assert [(m.name, m.model) for m in got] == [("chat", str(tmp_path / "chat")), ("m", "/x/m.gguf")]
    assert [m.name for m in served_models(parser.parse_args(["serve", "--model", "org/a", "--model", "org/b"]))] \
        == ["org/a", "org/b"]


def test_the_fleet_plan_parses_in_every_service():
    """Each model's gpu workers and data worker get its own deployment; the conductor and
    the api get the list; only the first --models-max models' workers start."""
    d = Deployment(page_size=32)
    models = [ServedModel("a", "/m/a"), ServedModel("b", "/m/b"), ServedModel("c", "/m/c")]
    children = plan_fleet(d, "/run", "127.0.0.1", 8000, 2, [], models, 1)
    by_model = {}
    for child in children:
        service = child.argv[2].removeprefix("services.")
        args = importlib.import_module(f"services.{service}.__main__").build_parser().parse_args(child.argv[3:])
        got = deployment_from_args(args)
        if service in ("conductor", "api"):
            assert [m.name for m in decode_models(args.models)] == ["a", "b", "c"]
            assert got.page_size == 32 or service == "api"
        else:
            assert got.page_size == 32
            by_model.setdefault(got.model, []).append((service, child.wanted))
    assert by_model["/m/a"] == [("gpu_worker", True), ("gpu_worker", True), ("data_worker", True)]
    assert by_model["/m/c"] == [("gpu_worker", False), ("gpu_worker", False), ("data_worker", True)]


def test_metrics_merge_by_family():
    a = ('# HELP m_total x\n# TYPE m_total counter\nm_total{model_name="a"} 1.0\n'
         '# HELP g y\n# TYPE g gauge\ng{model_name="a"} 2.0\n')
    b = a.replace('"a"', '"b"')
    merged = merge_metrics([a, b]).splitlines()
    assert merged == ["# HELP m_total x", "# TYPE m_total counter", 'm_total{model_name="a"} 1.0',
                      'm_total{model_name="b"} 1.0', "# HELP g y", "# TYPE g gauge", 'g{model_name="a"} 2.0',
                      'g{model_name="b"} 2.0']


# ---- the conductor's choice of loaded models (--models-max), in process ---------------------


def _fleet(models_max: int):
    from services.conductor.fleet import Fleet

    served = [(ServedModel(n, f"/m/{n}"), None, None) for n in ("a", "b", "c")]
    return Fleet(Deployment(), served, {"conductor": "ipc://x", "conductor_control": "ipc://y"}, models_max)


def _queue(fleet, model: str, rid: str, at: float) -> None:
    from shared.frames import NewRequest, SamplingParams

    c = fleet.conductors[model]
    c.queue.append((NewRequest(rid, model, {}, SamplingParams(), "ipc://api", 3), []))
    c.queued_at[rid] = at


def _busy(fleet, model: str) -> None:
    from services.conductor.conductor import WorkerState

    c = fleet.conductors[model]
    c.workers["w-" + model] = WorkerState("w-" + model, "ipc://w-" + model, {}, "inc-" + model,
                                          requests={"running": ({}, "ipc://api")})


def test_lru_loads_a_waiting_model_once_the_least_recently_used_drained():
    import asyncio

    fleet = _fleet(2)
    assert fleet.wanted == {"a": True, "b": True, "c": False}
    _busy(fleet, "a")
    _busy(fleet, "b")
    fleet.last_used.update(a=2.0, b=1.0)
    _queue(fleet, "c", "r1", 5.0)
    asyncio.run(fleet.reconcile())
    # b was used least recently: it drains (places nothing more) but runs its request to the end
    assert fleet.draining == {"b"} and fleet.conductors["b"].paused and fleet.wanted["b"]
    assert not fleet.wanted["c"]
    fleet.conductors["b"].workers["w-b"].requests.clear()  # its request finished
    asyncio.run(fleet.reconcile())
    assert fleet.wanted == {"a": True, "b": False, "c": True}
    assert fleet.conductors["b"].workers == {} and "inc-b" in fleet.retired  # its late beats are ignored
    assert [m.status for m in fleet.model_states()] == ["loaded", "unloaded", "loading"]


def test_a_busy_model_cannot_starve_an_older_request():
    import asyncio

    fleet = _fleet(1)
    _busy(fleet, "a")
    _queue(fleet, "a", "late", 9.0)  # a is busy and has a queue, but of a younger request
    _queue(fleet, "b", "early", 5.0)
    asyncio.run(fleet.reconcile())
    assert fleet.draining == {"a"}
    fleet2 = _fleet(1)
    _busy(fleet2, "a")
    _queue(fleet2, "a", "early", 1.0)  # a's own older request waits: a stays
    _queue(fleet2, "b", "late", 5.0)
    asyncio.run(fleet2.reconcile())
    assert fleet2.draining == set() and fleet2.wanted == {"a": True, "b": False, "c": False}


# ---- the api's router, in process over two stand-in apps ----------------------------------


def _router():
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route, WebSocketRoute

    from services.api.fleet import ModelRouter

    def app(name: str) -> Starlette:
        async def echo(request):
            body = await request.body()
            return JSONResponse({"app": name, "bytes": len(body)})

        async def stored(request):
            found = request.path_params["rid"] == f"resp-{name}"
            return JSONResponse({"app": name}, 200 if found else 404)

        async def socket(ws):
            await ws.accept()
            await ws.send_json({"app": name})
            await ws.close()

        return Starlette(routes=[WebSocketRoute("/generate/ws", socket),
                                 Route("/v1/chat/completions", echo, methods=["POST"]),
                                 Route("/v1/audio/transcriptions", echo, methods=["POST"]),
                                 Route("/generate", echo, methods=["POST"]),
                                 Route("/v1/responses/{rid}", stored, methods=["GET"])])

    return ModelRouter({"a": app("a"), "b": app("b")}, 1 << 20)


def test_the_router_hands_each_request_to_its_models_app():
    from starlette.testclient import TestClient

    client = TestClient(_router())
    body = json.dumps({"model": "b", "messages": [{"role": "user", "content": "x" * 100}]}).encode()
    r = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.json() == {"app": "b", "bytes": len(body)}  # the body replayed whole
    assert client.post("/v1/chat/completions", json={"messages": []}).json()["app"] == "a"  # none named: default
    assert client.post("/generate", json={"prompt": "hi"}).json()["app"] == "a"  # no model field: default
    assert client.post("/generate", content=b"not json").json()["app"] == "a"  # its app's 400 says why
    form = client.post("/v1/audio/transcriptions", files={"file": ("a.wav", b"RIFF")}, data={"model": "b"})
    assert form.json()["app"] == "b"
    r = client.post("/v1/chat/completions", json={"model": "zz", "messages": []})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found" and "`a`, `b`" in r.json()["error"]["message"]
    r = client.post("/v1/messages", json={"model": "zz"})
    assert r.status_code == 404 and r.json()["type"] == "error"  # Anthropic's shape
    assert client.get("/v1/responses/resp-b").json() == {"app": "b"}  # asked of each app in turn
    assert client.get("/v1/responses/resp-none").status_code == 404


def test_a_websocket_goes_to_its_query_models_app_and_an_unknown_one_is_refused():
    """`?model=` picks the app; none named is the default's; an unknown name refuses the
    handshake with the HTTP routes' 404 `model_not_found` (a close with 1008 where the
    server cannot answer a handshake with a response)."""
    import asyncio

    from starlette.testclient import TestClient, WebSocketDenialResponse

    router = _router()
    client = TestClient(router)
    for query, app in (("?model=b", "b"), ("", "a"), ("?model=", "a")):
        with client.websocket_connect("/generate/ws" + query) as ws:
            assert ws.receive_json() == {"app": app}
    with pytest.raises(WebSocketDenialResponse) as info, client.websocket_connect("/generate/ws?model=zz"):
        pass
    assert info.value.status_code == 404
    err = info.value.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model" and "`a`, `b`" in err["message"]

    sent = []

    async def receive():
        return {"type": "websocket.connect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "websocket", "path": "/generate/ws", "query_string": b"model=" + b"z" * 200, "headers": []}
    asyncio.run(router(scope, receive, send))
    assert [(m["type"], m["code"]) for m in sent] == [("websocket.close", 1008)]
    assert sent[0]["reason"].startswith("The model `zzz") and len(sent[0]["reason"].encode()) <= 123


def test_the_api_assembles_one_app_per_model_behind_one_key(tmp_path):
    """`python -m services.api --models ...` in process: each model's card from its own app,
    the API key checked once in front of them all (the router's own routes included)."""
    from starlette.testclient import TestClient

    from services.api.__main__ import _build_app, build_parser

    models = [ServedModel(name, "null", f"ipc://{tmp_path}/dw-{name}.sock", f"ipc://{tmp_path}/api-{name}.sock")
              for name in ("one", "two")]  # the null model twice: no weights, no torch
    args = build_parser().parse_args(["--models", encode_models(models), "--api-key", "k"])
    addrs = {"api": "", "data_worker": "", "conductor": f"ipc://{tmp_path}/c.sock",
             "conductor_control": f"ipc://{tmp_path}/cc.sock"}
    app, settings, router = _build_app(args, addrs, "")
    assert settings.model_name == "one" and router.names == ("one", "two")
    with TestClient(app) as client:
        assert client.get("/v1/models").status_code == 401
        cards = client.get("/v1/models", headers={"Authorization": "Bearer k"}).json()["data"]
        assert [(c["id"], c["task"]) for c in cards] == [("one", "generate"), ("two", "generate")]
        r = client.post("/v1/completions", json={"model": "three", "prompt": "x"},
                        headers={"Authorization": "Bearer k"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
