"""accel-dash's web app (Starlette): one read-only page, its data as JSON, and the static files it needs, nothing
from elsewhere (a Content-Security-Policy of 'self' makes the browser refuse anything else)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from lightning_accel.dash.state import DashState

__all__ = ["LOOPBACK", "STATIC", "make_app"]

STATIC = Path(__file__).parent / "static"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        b"connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    (b"cache-control", b"no-store"),
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]


def _host_of(scope: Scope) -> str:
    """The host name of the request's `Host` header, without its port (`[::1]:8765` -> `[::1]`)."""
    value = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"host"), "")
    if value.startswith("["):
        return value[: value.find("]") + 1] if "]" in value else value
    return value.split(":", 1)[0]


class _Guard:
    """Adds the headers above to every response; with `allowed_hosts`, answers 400 to any other `Host`."""

    def __init__(self, app: ASGIApp, allowed_hosts: tuple[str, ...] | None = None) -> None:
        self.app, self.allowed_hosts = app, allowed_hosts

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.allowed_hosts is not None and _host_of(scope) not in self.allowed_hosts:
            from starlette.responses import PlainTextResponse

            response = PlainTextResponse("accel-dash serves this address only as 127.0.0.1 or localhost", 400)
            await response(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *_HEADERS]
            await send(message)

        await self.app(scope, receive, send_with_headers)


def make_app(state: DashState, loopback: bool = True) -> Any:
    """The Starlette app: `GET /` (the page), `GET /api/state` (its data), `GET /usage` and `GET /api/usage` (the
    usage kept, the last 30 days), `GET /static/...`; every other method
    gets 405, nothing changes anything. On a loopback address only `Host: 127.0.0.1|localhost|[::1]` is served, so a
    web page elsewhere cannot reach it by rebinding a DNS name to 127.0.0.1."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import FileResponse, Response
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles

    def page(request: Request) -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html; charset=utf-8")

    def data(request: Request) -> Response:  # sync: Starlette runs it in a thread (it reads files and NVML)
        return Response(state.get(), media_type="application/json")

    def usage_page(request: Request) -> FileResponse:
        return FileResponse(STATIC / "usage.html", media_type="text/html; charset=utf-8")

    def usage_data(request: Request) -> Response:  # sync: it reads the usage databases, read-only
        return Response(state.usage_json(), media_type="application/json")

    middleware = [Middleware(_Guard, allowed_hosts=("127.0.0.1", "localhost", "[::1]") if loopback else None)]
    routes = [
        Route("/", page, methods=["GET", "HEAD"]),
        Route("/api/state", data, methods=["GET", "HEAD"]),
        Route("/usage", usage_page, methods=["GET", "HEAD"]),
        Route("/api/usage", usage_data, methods=["GET", "HEAD"]),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    return Starlette(routes=routes, middleware=middleware)
