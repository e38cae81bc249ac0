"""ASGI middleware in front of every route: requests a browser forged, the token, then a JSON body
read, capped and parsed once.

A web page open in a browser on the same machine can send requests to a service on loopback:
form posts and `text/plain` bodies need no CORS preflight, and DNS rebinding lets such a page read
the answers. So every request with an `Origin` other than the service's own is refused (403),
without a token a `Host` that is not the bound address, localhost or an allowed name is refused
(403: a rebound page sends its own name), and a JSON endpoint takes only `Content-Type:
application/json` (415). Bodies are read once, size-capped (413) and parsed here (400 for
malformed or too deeply nested JSON), so bad input always gets a 4xx that says what to fix.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import re
import time
import typing
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

from codeenv.api.body import Body, BodyParser
from codeenv.errors import ApiError
from codeenv.settings import GatewaySettings

#: Where Guard leaves the time (monotonic) a request arrived: its calls' queue wait starts there.
ACCEPTED = "codeenv.accepted"
#: Where Guard leaves a JSON POST's list of what to run once its answer is sent (or the request
#: ended otherwise): its calls' end to end and overhead are observed there.
ANSWERED = "codeenv.answered"
#: Where Guard leaves a request's parsed JSON body.
JSON_BODY = "codeenv.json"
#: The live page's own files, which hold no data (its data, /v1/live, needs the token): open without
#: it, so that a browser opens the page, which then asks for the token.
PAGE_PATHS = frozenset({"/", "/live.js", "/live.css"})
#: The API's documents: with a token they need it too, which a browser does not send.
DOCS_PATHS = frozenset({"/docs", "/redoc", "/openapi.json"})
DOCS_HINT = ("; a browser sends none, so with a token /docs cannot open in it: download the document with "
             "the token (curl -H 'Authorization: Bearer <token>' http://HOST:PORT/openapi.json -o openapi.json) "
             "and open it in any OpenAPI viewer, or open /docs of a service without a token on your own machine "
             "(codeenv serve on loopback)")


Endpoint = Callable[[Request], Awaitable[Response]]
Handlers = Mapping[Any, Callable[[Request, Exception], Any]]


def direct_routes(routes: Iterable[Any], paths: Iterable[str]) -> dict[str, Endpoint]:
    """The JSON POST routes the Guard calls itself, path -> endpoint, instead of handing the request
    to the router: for each of `paths` (no parameters in them), the route the router takes for a
    POST to it (the first whose pattern and method match), if its endpoint takes the request alone
    (nothing for FastAPI to solve or validate) and answers a Response (which FastAPI passes on as it
    is).

    For these the router's walk (every route matched in turn), FastAPI's request handler and its
    middleware layers were a third of a request's work in the gateway (`benchmarks/counts.py`) and
    did nothing: the Guard has read and parsed the body already, and the endpoint answers through
    the app's own exception handlers as before.
    """
    matchers = templated_routes(routes)
    found: dict[str, Endpoint] = {}
    for path in paths:
        taken = _first(matchers, path)
        if taken is not None and taken[0].endpoint is not None and not taken[0].convertors:
            found[path] = taken[0].endpoint
    return found


class Matcher(NamedTuple):
    """A route as the router matches it: its path's pattern, its methods (None: any), and the
    endpoint the Guard calls itself (None: the request goes to the router)."""

    pattern: re.Pattern[str]
    methods: frozenset[str] | None
    convertors: Mapping[str, Any]
    endpoint: Callable[..., Awaitable[Response]] | None
    request_param: str  # the name the endpoint takes the request by


def templated_routes(routes: Iterable[Any]) -> list[Matcher]:
    """Every route in the router's order: the first whose pattern and method match a POST is the
    one the router would take (for the routes with ids in their path, a session's cell, fork or
    snapshot, looked up per request; for the others once, by `direct_routes`). The Guard calls it
    itself if its endpoint takes the path's parameters (text) and the request, and nothing else,
    and answers a Response. A route that is not described by a pattern ends the list: what
    follows it goes to the router."""
    found: list[Matcher] = []
    for route in routes:
        pattern = getattr(route, "path_regex", None)
        if pattern is None:
            break
        convertors = getattr(route, "param_convertors", {})
        methods = getattr(route, "methods", None)
        name = _request_param(route) if isinstance(route, APIRoute) else None
        found.append(Matcher(pattern, frozenset(methods) if methods is not None else None, convertors,
                             route.endpoint if name is not None else None, name or ""))
    return found


def _first(matchers: Iterable[Matcher], path: str) -> tuple[Matcher, re.Match[str]] | None:
    """The route the router takes for a POST to `path`, with its match; None: no route listed does."""
    for matcher in matchers:
        match = matcher.pattern.match(path)
        if match is not None and (matcher.methods is None or "POST" in matcher.methods):
            return matcher, match
    return None


def _request_param(route: APIRoute) -> str | None:
    """The name of its request parameter, if the route's endpoint is a coroutine that takes
    `request: Request` and, as text with no default, each of the path's parameters, and nothing
    else (no dependency, of its own or its router's: nothing for FastAPI to solve or validate), and
    answers a Response; else None."""
    endpoint, dependant = route.endpoint, route.dependant
    if (not inspect.iscoroutinefunction(endpoint) or route.dependencies or dependant.dependencies
            or dependant.query_params or dependant.header_params or dependant.cookie_params
            or dependant.body_params or dependant.request_param_name is None):
        return None
    try:
        hints = typing.get_type_hints(endpoint)
    except (NameError, TypeError):
        return None
    params = list(inspect.signature(endpoint).parameters.values())
    if any(p.kind is not p.POSITIONAL_OR_KEYWORD or p.default is not p.empty for p in params):
        return None
    texts = {p.name for p in params if hints.get(p.name) is str}
    requests = [p.name for p in params if hints.get(p.name) is Request]
    returned = hints.get("return")
    if (len(params) == len(texts) + 1 and requests == [dependant.request_param_name]
            and texts == set(route.param_convertors) and isinstance(returned, type)
            and issubclass(returned, Response)):
        return requests[0]
    return None


class Guard:
    """The token, then the body of the POST routes that take JSON (`json_paths`).

    The body is read here once, capped (413) and parsed (400), and left in the scope; the app then
    sees an empty body followed by the client's real messages, so an endpoint can still notice
    the client hanging up (http.disconnect) while its calls wait. The routes in `direct` are called
    from here (see `direct_routes`), their errors answered by the app's `handlers`.
    """

    def __init__(self, app: Any, settings: GatewaySettings, json_paths: Iterable[str],
                 json_route: Callable[[str, str], bool] | None = None, parser: BodyParser | None = None,
                 ticketed: Callable[[dict[str, Any]], bool] | None = None,
                 direct: Mapping[str, Endpoint] | None = None, templated: Sequence[Matcher] = (),
                 handlers: Handlers | None = None) -> None:
        """`json_route(method, path)`: also a route that takes JSON (paths with ids in them);
        `parser`: what parses the bodies (its owner closes it); `ticketed(scope)`: a request that
        carries a ticket standing for the token (a worker's fetch of one problem package);
        `direct`, `templated` (see `templated_routes`) and `handlers`: read at each request (the app
        fills them once its routes exist)."""
        self.direct: Mapping[str, Endpoint] = direct if direct is not None else {}
        self.templated = templated
        self.handlers: Handlers = handlers if handlers is not None else {}
        self.ticketed = ticketed
        self.app = app
        self.parser = parser or BodyParser()
        self.settings = settings
        self.json_paths = frozenset(json_paths)
        self.json_route = json_route
        self.expected = f"Bearer {settings.token}".encode() if settings.token is not None else None
        bound = settings.host.strip("[]").lower()
        self.hosts = {bound, "localhost", "127.0.0.1", "::1", *(h.lower() for h in settings.allowed_hosts)}
        self.origins = {o.rstrip("/").lower() for o in settings.allowed_origins}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[ACCEPTED] = time.monotonic()
        try:
            headers = dict(scope["headers"])
            self._check_browser(headers, scope.get("scheme", "http"))
            if self.expected is not None and not (scope["path"] in PAGE_PATHS and scope["method"] in ("GET", "HEAD")):
                given = headers.get(b"authorization", b"")
                if not hmac.compare_digest(given, self.expected) and not (self.ticketed and self.ticketed(scope)):
                    raise ApiError(401, "missing or wrong token: send 'Authorization: Bearer <token>'"
                                        + (DOCS_HINT if scope["path"] in DOCS_PATHS
                                           or scope["path"].startswith("/docs/") else ""))
            listed = scope["path"] in self.json_paths
            routed = not listed and self.json_route is not None and self.json_route(scope["method"], scope["path"])
            if scope["method"] == "POST" and (listed or routed):
                media = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
                # The session routes (`json_route`) also take no body at all, as {}: sent without a
                # Content-Type, or as an empty application/json body (what `requests.post(url,
                # headers=...)` or `curl -X POST -H 'Content-Type: application/json'` send).
                empty_ok = routed and not media and headers.get(b"content-length", b"0") == b"0"
                if media != b"application/json" and not empty_ok:
                    shown = media.decode("latin-1") or "none"
                    raise ApiError(415, f"send the body as JSON with 'Content-Type: application/json' (got {shown})")
                body = await self._read_body(headers, receive)
                if body is None:
                    return  # the client went away while sending
                if routed and body.is_blank():
                    body.close()
                    scope[JSON_BODY] = {}
                else:
                    scope[JSON_BODY] = await self.parser.parse(body)  # the parsed value is all that is kept
                replayed = False

                async def replay() -> dict[str, Any]:
                    nonlocal replayed
                    if not replayed:
                        replayed = True
                        return {"type": "http.request", "body": b"", "more_body": False}
                    message: dict[str, Any] = await receive()
                    return message

                endpoint = self.direct.get(scope["path"]) if listed else self._templated(scope)
                answered: list[Callable[[], None]] = []
                scope[ANSWERED] = answered
                try:
                    if endpoint is None:
                        await self.app(scope, replay, send)
                    else:
                        await self._call(endpoint, scope, replay, send)
                finally:  # the answer is sent (or the request ended otherwise)
                    for then in answered:
                        then()
                return
        except ApiError as exc:
            await JSONResponse({"detail": exc.detail}, exc.status_code, exc.headers)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _templated(self, scope: dict[str, Any]) -> Endpoint | None:
        """The endpoint of the route that takes this POST (see `templated_routes`), with the path's
        parameters bound and left in the scope as the router leaves them; None: the router's."""
        found = _first(self.templated, scope["path"])
        if found is None:
            return None
        matcher, match = found
        endpoint, name = matcher.endpoint, matcher.request_param
        if endpoint is None:
            return None
        params = {key: matcher.convertors[key].convert(value) for key, value in match.groupdict().items()}
        scope["path_params"] = params
        return lambda request: endpoint(**params, **{name: request})

    async def _call(self, endpoint: Endpoint, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """A direct route's endpoint, its error answered by the app's handler for it as Starlette's
        ExceptionMiddleware picks it (an HTTPException's status first, then the class's MRO; the
        handlers of 500 and Exception are the server error middleware's: such an error goes on up)."""
        request = Request(scope, receive, send)
        try:
            response = await endpoint(request)
        except Exception as exc:
            handler = None
            if isinstance(exc, StarletteHTTPException) and exc.status_code != 500:
                handler = self.handlers.get(exc.status_code)
            if handler is None:
                handler = next((self.handlers[c] for c in type(exc).__mro__
                                if c in self.handlers and c is not Exception), None)
            if handler is None:
                raise
            if inspect.iscoroutinefunction(handler):
                response = await handler(request, exc)
            else:
                response = await run_in_threadpool(handler, request, exc)
            if response is None:
                return
        await response(scope, receive, send)

    def _check_browser(self, headers: dict[bytes, bytes], scheme: str) -> None:
        host = headers.get(b"host", b"").decode("latin-1").lower()
        if self.expected is None and host and _hostname(host) not in self.hosts:
            raise ApiError(403, f"Host {host!r} is not this service's address: without a token the service answers "
                                "only its bound address and localhost; add the name to CODEENV_ALLOWED_HOSTS, or "
                                "set a token")
        origin = headers.get(b"origin")
        if origin is not None:
            given = origin.decode("latin-1").rstrip("/").lower()
            if given not in self.origins and given != f"{scheme}://{host}":
                raise ApiError(403, f"requests from web pages of other origins are refused (Origin: {given}); "
                                    "to allow one, add it to CODEENV_ALLOWED_ORIGINS")

    async def _read_body(self, headers: dict[bytes, bytes], receive: Any) -> Body | None:
        max_bytes = self.settings.max_body_bytes
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > max_bytes:
            raise ApiError(413, f"the body is {int(declared)} bytes; the limit is {max_bytes}")
        try:
            async with asyncio.timeout(self.settings.body_timeout_s):
                return await self._receive_body(receive, max_bytes)
        except TimeoutError:
            # 408 with "Connection: close": uvicorn then closes the connection, and the fd is free.
            raise ApiError(408, f"the body did not arrive within {self.settings.body_timeout_s:g}s "
                                "(body_timeout_s); send it whole, promptly", {"Connection": "close"}) from None

    @staticmethod
    async def _receive_body(receive: Any, max_bytes: int) -> Body | None:
        body = Body()
        try:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    body.close()
                    return None
                chunk = message.get("body", b"")
                if body.size + len(chunk) > max_bytes:
                    raise ApiError(413, f"the body is over the limit of {max_bytes} bytes")
                body.add(chunk)
                if not message.get("more_body", False):
                    return body
        except BaseException:
            body.close()
            raise


def _hostname(host: str) -> str:
    """The name of a Host header, without its port ("[::1]:8000" -> "::1")."""
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host
