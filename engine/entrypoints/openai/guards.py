"""What stands at the server's door before any route runs (pure ASGI, so websockets pass through it too):

- `BodyLimitMiddleware`: a request body past `max_request_body_bytes` is a 413 in OpenAI's shape, announced
  (Content-Length) or not (a chunked body is counted as it arrives and cut at the limit): a client cannot make the
  server hold an unbounded body, nor make the JSON parser walk one.
- `ApiKeyMiddleware`: one key for every door. With `--api-key`, every route but /health and /metrics (open to load
  balancers and Prometheus, as vLLM leaves them) needs the key: as `Authorization: Bearer KEY` (API clients), or
  the session cookie a browser gets once from the login form at /login or from `?key=KEY` on any page. That covers
  the dashboard's page, its resources, its Bokeh websocket (through which every button acts) and the hold routes.
  The cookie holds an HMAC of the key, never the key; it is HttpOnly and SameSite=Strict (another site's page
  cannot drive the server with it)."""

from __future__ import annotations

import hashlib
import hmac
import html
from collections.abc import Awaitable, Callable
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import parse_qs, urlencode

from fastapi import HTTPException
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from engine.entrypoints.openai.serving_engine import error_response

ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]
DEFAULT_MAX_REQUEST_BODY_BYTES = 4 << 20  # 4 MiB: a prompt of 100k+ tokens as text or ids; far from any OOM
OPEN_PATHS = ("/health", "/metrics")
LOGIN_PATH = "/login"
COOKIE = "workbench_session"
# the routes API clients call: refused with OpenAI's JSON error; anything else (the dashboard's page) with the form
API_PREFIXES = (
    "/v1/",
    "/pause",
    "/resume",
    "/step",
    "/is_paused",
    "/start_profile",
    "/stop_profile",
    "/openapi.json",
    "/docs",
    "/redoc",
)


class BodyLimitMiddleware:
    """Owns the body-size limit of every HTTP request (413 past `max_bytes`, counted before the route reads it)."""

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:  # said up front: refused before a byte is read
            return await self._too_large(int(declared))(scope, receive, send)
        seen = 0

        async def counted() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                # raised inside the route's body read: FastAPI re-raises HTTPExceptions as they are, and the app's
                # handler answers in OpenAI's shape (serving_engine.error_response)
                raise HTTPException(413, self._message(f"more than {self.max_bytes}"))
            return message

        await self.app(scope, counted, send)

    def _message(self, size: str) -> str:
        return f"request body: at most {self.max_bytes} bytes (max_request_body_bytes), got {size}"

    def _too_large(self, size: int) -> Response:
        return error_response(413, self._message(str(size)))


def session_token(api_key: str) -> str:
    """What the session cookie holds: an HMAC of the key (the key itself never sits in a cookie)."""
    return hmac.new(api_key.encode(), b"inference-workbench session", hashlib.sha256).hexdigest()


class ApiKeyMiddleware:
    """Owns the API key check of every request and websocket (all but OPEN_PATHS), the login form and the session
    cookie. Compared in constant time (no timing oracle on the key)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._bearer = f"Bearer {api_key}".encode()
        self._key = api_key.encode()
        self._token = session_token(api_key).encode()

    def _valid_key(self, given: str) -> bool:
        return hmac.compare_digest(given.encode(), self._key)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        if hmac.compare_digest(headers.get(b"authorization", b""), self._bearer):
            return True
        cookie = SimpleCookie()
        try:
            cookie.load(headers.get(b"cookie", b"").decode("latin-1"))
        except Exception:  # a malformed Cookie header is no session, not a server error
            return False
        morsel = cookie.get(COOKIE)
        return morsel is not None and hmac.compare_digest(morsel.value.encode(), self._token)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        headers = dict(scope.get("headers") or [])
        if scope["type"] == "http" and path == LOGIN_PATH:  # signed in or not: a second sign-in is harmless
            return await (await self._login(scope, receive))(scope, receive, send)
        if (
            path in OPEN_PATHS
            or (scope["type"] == "http" and scope.get("method") == "OPTIONS")
            or self._authorized(headers)
        ):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            # refused before the handshake completes (the browser sees a 403): no session, no button reaches the engine
            await receive()  # websocket.connect
            return await send({"type": "websocket.close", "code": 1008})
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        if scope.get("method") == "GET" and "key" in query and self._valid_key(query["key"][0]):
            rest = urlencode([(k, v) for k, vs in query.items() if k != "key" for v in vs], doseq=False)
            return await self._signed_in(path + (f"?{rest}" if rest else ""))(scope, receive, send)
        response: Response
        if path.startswith(API_PREFIXES) or b"text/html" not in headers.get(b"accept", b""):
            response = error_response(401, "Unauthorized: a valid `Authorization: Bearer KEY` is needed")
        else:  # a browser on a page: the form, which signs it in once for the session
            response = login_page(path, status=401)
        return await response(scope, receive, send)

    async def _login(self, scope: dict, receive: Callable) -> Response:
        """GET: the form. POST (form-encoded `key`, `next`): the cookie and back to `next`, or the form again."""
        if scope.get("method") != "POST":
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            return login_page(query.get("next", ["/"])[0])
        body, more = b"", True
        while more:  # bounded here: this middleware runs before BodyLimitMiddleware
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False) and len(body) <= 64 * 1024
        form = parse_qs(body[: 64 * 1024].decode("utf-8", "replace"))
        target = form.get("next", ["/"])[0]
        if self._valid_key(form.get("key", [""])[0]):
            return self._signed_in(target)
        return login_page(target, status=401, wrong=True)

    def _signed_in(self, target: str) -> Response:
        # only a path of this server: never an open redirect to another site ("//host", "http://...")
        if not target.startswith("/") or target.startswith("//"):
            target = "/"
        response = RedirectResponse(target, status_code=303)
        response.set_cookie(COOKIE, self._token.decode(), httponly=True, samesite="strict", path="/")
        return response


def login_page(target: str, status: int = 200, wrong: bool = False) -> HTMLResponse:
    """The form that asks for the API key once; the cookie it earns keeps the browser signed in for the session."""
    note = "<p role='alert'>That key is not this server's.</p>" if wrong else ""
    body = f"""<!doctype html><html><head><meta charset="utf-8"><title>Inference Workbench: API key</title></head>
<body style="font-family: sans-serif; margin: 3em">
<h1>Inference Workbench</h1><p>This server needs its API key (<code>--api-key</code>).</p>{note}
<form method="post" action="{LOGIN_PATH}">
<input type="hidden" name="next" value="{html.escape(target, quote=True)}">
<label>API key <input type="password" name="key" autofocus></label> <button type="submit">Sign in</button>
</form></body></html>"""
    return HTMLResponse(body, status_code=status)


def warn_if_exposed(host: str, api_key: str | None) -> str | None:
    """The warning `workbench serve` prints when it binds beyond the loopback without an API key: anyone who
    reaches the port can then read every request and pause, step and drive the engine. None when it does not."""
    import ipaddress

    if api_key:
        return None
    name = host.strip("[]").lower()
    if name == "localhost":
        return None
    try:
        if ipaddress.ip_address(name).is_loopback:
            return None
    except ValueError:
        pass  # a host name other than localhost: it may resolve to anything, so warn
    return (
        f"WARNING: serving on {host} without --api-key: anyone who can reach this port can read every request "
        "and pause, step and drive the engine from /dashboard and the API. Pass --api-key KEY, or bind 127.0.0.1."
    )


def install(app: Any, api_key: str | None, max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES) -> None:
    """Put the guards on `app`: the body limit, then (outermost, so an unauthenticated client is refused before
    its body is read) the key check when there is a key. Bad settings raise here, not at the first request."""
    if (
        isinstance(max_request_body_bytes, bool)
        or not isinstance(max_request_body_bytes, int)
        or max_request_body_bytes < 1
    ):
        raise ValueError(f"max_request_body_bytes: must be an int >= 1, got {max_request_body_bytes!r}")
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise ValueError("api_key: must be a non-empty string")
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_body_bytes)
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
