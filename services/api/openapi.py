"""`/openapi.json`: the OpenAPI 3.1 document of every route's declared shapes (`schemas.py`
and the dialects' `SHAPES`), generated from the same msgspec Structs the routes decode, as
vLLM and SGLang publish theirs.
"""

from __future__ import annotations

from typing import Any

import msgspec

from services.api.events import GenerateResponse
from services.api.schemas import (
    UNSUPPORTED,
    ActionRequest,
    ActionResponse,
    AudioGenerateForm,
    Body,
    ClientFrame,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    ErrorResponse,
    GenerateRequest,
    RerankRequest,
    RerankResponse,
    RolloutRequest,
    RolloutResponse,
    Route,
    ScoreRequest,
    ScoreResponse,
    SpeechRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    TranscriptionForm,
    VersionResponse,
)

#: (path, method) -> its shapes, for the routes outside the dialects (each dialect's are its
#: package's `SHAPES`); `/openapi.json` is generated from this table and theirs
ROUTES: dict[tuple[str, str], Route] = {
    ("/generate", "post"): Route(GenerateRequest, GenerateResponse, form=AudioGenerateForm),
    ("/v1/audio/transcriptions", "post"): Route(form=TranscriptionForm),
    ("/v1/audio/speech", "post"): Route(SpeechRequest),
    ("/tokenize", "post"): Route((TokenizeCompletionRequest, TokenizeChatRequest), TokenizeResponse),
    ("/detokenize", "post"): Route(DetokenizeRequest, DetokenizeResponse),
    ("/version", "get"): Route(response=VersionResponse),
    ("/v1/embeddings", "post"): Route(EmbeddingRequest, EmbeddingResponse),
    ("/v1/actions", "post"): Route(ActionRequest, ActionResponse),
    ("/v1/world/rollout", "post"): Route(RolloutRequest, RolloutResponse),
    **{(path, "post"): Route(ScoreRequest, ScoreResponse) for path in ("/v1/score", "/score")},
    **{(path, "post"): Route(RerankRequest, RerankResponse) for path in ("/v1/rerank", "/rerank", "/v2/rerank")},
}
#: components published besides the routes' (OpenAPI has no WebSocket operations)
EXTRA_COMPONENTS: dict[str, Any] = {"WebSocketClientFrame": ClientFrame}
FILE_PART = {"type": "string", "contentMediaType": "application/octet-stream",
             "description": "the audio file (WAV or FLAC)"}
REF = "#/components/schemas/{name}"


def _declare_unsupported(component: dict[str, Any], cls: type[Body]) -> None:
    """List in a body's schema the unsupported fields it tolerates with their neutral values."""
    if not cls.takes_unsupported:
        return
    declared = {f.encode_name for f in msgspec.structs.fields(cls)}
    properties = component.setdefault("properties", {})
    for name, (neutral, message) in UNSUPPORTED.items():
        if name not in declared:
            properties[name] = {"enum": [None, *neutral], "description": message}


def openapi(version: str, extra: dict[tuple[str, str], Route] | None = None) -> dict[str, Any]:
    """The OpenAPI 3.1 document of `ROUTES` and the dialects' `extra` routes: paths with
    their bodies and replies, and every Struct as a component."""
    routes = {**ROUTES, **(extra or {})}
    bodies = {route: route.body if isinstance(route.body, tuple) else (route.body,) for route in routes.values()
              if route.body is not None}
    types: list[Any] = [t for route in routes.values() for t in (route.response, route.form) if t is not None]
    types += [t for group in bodies.values() for t in group] + [ErrorResponse, *EXTRA_COMPONENTS.values()]
    schemas, components = msgspec.json.schema_components(types, ref_template=REF)
    schema_of = dict(zip(types, schemas, strict=True))
    components.update({name: schema_of[tp] for name, tp in EXTRA_COMPONENTS.items()})
    error = {"application/json": {"schema": schema_of[ErrorResponse]}}
    paths: dict[str, dict[str, Any]] = {}
    for (path, method), route in routes.items():
        content: dict[str, Any] = {}
        if route in bodies:
            for cls in bodies[route]:
                _declare_unsupported(components[cls.__name__], cls)
            refs = [schema_of[cls] for cls in bodies[route]]
            content["application/json"] = {"schema": refs[0] if len(refs) == 1 else {"oneOf": refs}}
        if route.form is not None:
            form = components[route.form.__name__]
            _declare_unsupported(form, route.form)
            form["properties"]["file"] = FILE_PART
            form["required"] = sorted({*form.get("required", ()), "file"})
            content["multipart/form-data"] = {"schema": schema_of[route.form]}
        streams = any("stream" in t.__struct_fields__ for t in (*bodies.get(route, ()), route.form) if t is not None)
        ok: dict[str, Any] = {"description": "OK (with `stream: true`, Server-Sent Events)" if streams else "OK"}
        if route.response is not None:
            ok["content"] = {"application/json": {"schema": schema_of[route.response]}}
        name = "_".join(part.strip("{}") for part in path.split("/") if part)
        operation: dict[str, Any] = {"operationId": f"{method}_{name}",
                                     "responses": {"200": ok, "default": {"description": "an error", "content": error}}}
        params = [part.strip("{}") for part in path.split("/") if part.startswith("{")]
        if params:
            operation["parameters"] = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
                                       for p in params]
        if content:
            operation["requestBody"] = {"required": True, "content": content}
        paths.setdefault(path, {})[method] = operation
    return {"openapi": "3.1.0", "info": {"title": "mstar", "version": version}, "paths": paths,
            "components": {"schemas": components}}
