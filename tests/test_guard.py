"""The Guard calls JSON POST endpoints itself (codeenv/api/guard.py): the same route and the same
answers as the router would give, errors through the app's exception handlers."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Path, Request
from fastapi.responses import JSONResponse, Response

from codeenv.api.guard import JSON_BODY, Guard, Matcher, direct_routes, templated_routes
from codeenv.errors import ApiError
from codeenv.settings import GatewaySettings

pytestmark = pytest.mark.unit


def make_app() -> tuple[FastAPI, list[Matcher], dict[str, Any]]:
    app = FastAPI()
    direct: dict[str, Any] = {}
    templated: list[Matcher] = []
    app.add_middleware(Guard, settings=GatewaySettings(), json_paths={"/plain", "/shadowed/plain"},
                       json_route=lambda method, path: method == "POST" and path.startswith("/items/"),
                       direct=direct, templated=templated, handlers=app.exception_handlers)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> Response:
        return JSONResponse({"detail": exc.detail}, exc.status_code, exc.headers)

    @app.exception_handler(409)  # by status, as Starlette picks it for an HTTPException
    async def conflict(_: Request, exc: Exception) -> Response:
        return JSONResponse({"conflict": True}, 409)

    @app.post("/shadowed/{anything}")  # takes /shadowed/plain before the static route below
    async def shadowing(anything: str, request: Request) -> Response:
        return JSONResponse({"route": "shadowing"})

    @app.post("/shadowed/plain")
    async def shadowed(request: Request) -> Response:
        return JSONResponse({"route": "shadowed"})

    @app.post("/plain")
    async def plain(request: Request) -> Response:
        body = request.scope[JSON_BODY]
        if body.get("fail"):
            raise ApiError(418, "asked to fail")
        return JSONResponse({"route": "plain", "body": body})

    @app.post("/items/special/run")  # before the templated route: it takes this path, as in the router
    async def special(request: Request) -> Response:
        return JSONResponse({"route": "special"})

    @app.post("/items/{item_id}/run")
    async def run(item_id: str, request: Request) -> Response:
        if item_id == "missing":
            raise ApiError(404, f"no item {item_id}")
        if item_id == "taken":
            raise HTTPException(409, "taken")
        return JSONResponse({"route": "run", "item": item_id, "params": request.path_params,
                             "body": request.scope[JSON_BODY]})

    def dependency() -> str:
        return "solved"

    @app.post("/items/{item_id}/dep")  # a dependency: FastAPI's router must solve it
    async def dep(item_id: str, request: Request, value: str = Depends(dependency)) -> Response:
        return JSONResponse({"route": "dep", "item": item_id, "value": value})

    @app.get("/items/{item_id}/run")
    async def show(item_id: str) -> dict[str, str]:
        return {"route": "show", "item": item_id}

    @app.post("/items/{item_id}/checked")  # its parameter validated by FastAPI
    async def checked(request: Request, item_id: str = Path(pattern="^a+$")) -> Response:
        return JSONResponse({"route": "checked"})

    audited: list[str] = []
    app.state.audited = audited
    guarded = APIRouter(dependencies=[Depends(lambda: audited.append("seen"))])  # a router's dependency

    @guarded.post("/items/{item_id}/audited")
    async def audit(item_id: str, request: Request) -> Response:
        return JSONResponse({"route": "audited"})

    app.include_router(guarded)
    direct.update(direct_routes(app.router.routes, {"/plain", "/shadowed/plain"}))
    templated.extend(templated_routes(app.router.routes))
    return app, templated, direct


def test_which_routes_are_called_directly() -> None:
    _, templated, direct = make_app()
    assert set(direct) == {"/plain"}  # not /shadowed/plain: the router takes another route for it
    called = {m.pattern.pattern: m.endpoint.__name__ for m in templated
              if m.endpoint is not None and m.methods == frozenset({"POST"})}
    # Not dep, checked or audited: FastAPI solves or validates something for them.
    assert called == {"^/plain$": "plain", "^/items/special/run$": "special", "^/shadowed/(?P<anything>[^/]+)$":
                      "shadowing", "^/shadowed/plain$": "shadowed", "^/items/(?P<item_id>[^/]+)/run$": "run"}


async def test_answers_are_the_routers() -> None:
    app, _, _ = make_app()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as client:
        r = await client.post("/plain", json={"x": 1})
        assert r.json() == {"route": "plain", "body": {"x": 1}}
        r = await client.post("/plain", json={"fail": True})
        assert (r.status_code, r.json()) == (418, {"detail": "asked to fail"})
        r = await client.post("/items/special/run", json={})
        assert r.json() == {"route": "special"}
        r = await client.post("/items/a.b-c/run", json={"y": 2})
        assert r.json() == {"route": "run", "item": "a.b-c", "params": {"item_id": "a.b-c"}, "body": {"y": 2}}
        r = await client.post("/items/missing/run", json={})
        assert (r.status_code, r.json()) == (404, {"detail": "no item missing"})
        r = await client.post("/items/7/dep", json={})
        assert r.json() == {"route": "dep", "item": "7", "value": "solved"}
        r = await client.get("/items/7/run")
        assert r.json() == {"route": "show", "item": "7"}
        r = await client.post("/items/7/other", json={})
        assert r.status_code == 404
        r = await client.post("/items/7/run", content=b"{", headers={"content-type": "application/json"})
        assert r.status_code == 400
        r = await client.post("/items/taken/run", json={})
        assert (r.status_code, r.json()) == (409, {"conflict": True})
        r = await client.post("/shadowed/plain", json={})
        assert r.json() == {"route": "shadowing"}
        r = await client.post("/items/bbb/checked", json={})
        assert r.status_code == 422
        r = await client.post("/items/aa/checked", json={})
        assert r.json() == {"route": "checked"}
        r = await client.post("/items/7/audited", json={})
        assert r.json() == {"route": "audited"} and app.state.audited == ["seen"]


async def test_a_calls_end_to_end_ends_when_its_answer_is_sent() -> None:
    """The live page's end to end and overhead count the answer's encoding and sending: a connection
    that takes 0.3 s to take the answer shows in both, and not in the run time."""
    from codeenv.api.app import create_app
    from tests.fakes import FakeQueue

    app = create_app(GatewaySettings(slots=2), FakeQueue())

    async def slow_to_answer(scope: dict[str, Any], receive: Any, send: Any) -> None:
        async def sending(message: dict[str, Any]) -> None:
            if scope["path"] == "/v1/execute" and message["type"] == "http.response.body":
                await asyncio.sleep(0.3)
            await send(message)

        await app(scope, receive, sending)

    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=slow_to_answer),
                                     base_url="http://localhost") as client:
            assert (await client.post("/v1/execute", json={"code": "print(1)"})).json()["status"] == "ok"
            live = (await client.get("/v1/live")).json()
    finally:
        await app.state.parser.close()
    for name, took_the_send in (("end_to_end", True), ("overhead", True), ("run", False)):
        histogram = live["latency"][name]
        under_a_quarter_s = max(n for le, n in zip(live["le"], histogram["count"], strict=True) if le < 0.25)
        assert histogram["total"] == 1 and under_a_quarter_s == (0 if took_the_send else 1), (name, histogram)
