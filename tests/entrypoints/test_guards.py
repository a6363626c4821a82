"""The server's door without an engine (engine/entrypoints/openai/guards.py): with a key, every route but /health and
/metrics, pages and websockets included, needs it (a header, or the cookie the login form or `?key=` gives once);
without one, beyond the loopback, `workbench serve` warns loudly."""

from __future__ import annotations

import pytest
from fastapi import FastAPI, WebSocket
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from engine.entrypoints.openai import guards

KEY = "s3cret-key"
HTML = {"accept": "text/html,application/xhtml+xml"}


def _app() -> FastAPI:
    """A stand-in for the served app: an API route, a hold route, a dashboard page and its websocket."""
    app = FastAPI()
    guards.install(app, KEY, max_request_body_bytes=10_000)
    app.get("/health")(lambda: JSONResponse({}))
    app.get("/metrics")(lambda: JSONResponse({}))
    app.get("/v1/models")(lambda: JSONResponse({"data": []}))
    app.post("/step")(lambda: JSONResponse({"step": 1}))
    app.get("/dashboard")(lambda: HTMLResponse("<p>step 0</p>"))

    @app.websocket("/dashboard/ws")
    async def ws(websocket: WebSocket) -> None:
        await websocket.accept()
        await websocket.send_text("session")
        await websocket.close()

    return app


def test_without_the_key_every_door_but_health_and_metrics_is_shut():
    with TestClient(_app()) as client:
        assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200
        for method, path in (("GET", "/v1/models"), ("POST", "/step"), ("GET", "/dashboard")):
            reply = client.request(method, path)
            assert reply.status_code == 401 and reply.json()["error"]["type"] == "AuthenticationError", path
        page = client.get("/dashboard", headers=HTML)  # a browser: the form asking for the key, nothing else
        assert page.status_code == 401 and 'name="key"' in page.text and "step 0" not in page.text
        for headers in (
            {},
            {"authorization": "Bearer wrong"},
            {"cookie": f"{guards.COOKIE}=forged"},
            {"cookie": f"{guards.COOKIE}={KEY}"},
        ):  # the key itself is not the session token
            with pytest.raises(WebSocketDisconnect) as refused:
                with client.websocket_connect("/dashboard/ws", headers=headers) as ws:
                    ws.receive_text()
            assert refused.value.code == 1008
            assert client.get("/dashboard", headers=headers).status_code == 401
        assert client.get("/dashboard?key=wrong", headers=HTML, follow_redirects=False).status_code == 401


def test_the_key_opens_every_door_and_the_browser_keeps_it_for_the_session():
    with TestClient(_app()) as client:
        bearer = {"authorization": f"Bearer {KEY}"}
        assert client.get("/v1/models", headers=bearer).status_code == 200
        assert client.post("/step", headers=bearer).json() == {"step": 1}
        with client.websocket_connect("/dashboard/ws", headers=bearer) as ws:
            assert ws.receive_text() == "session"
    with TestClient(_app()) as browser:  # the login form: once, then the cookie
        wrong = browser.post(guards.LOGIN_PATH, data={"key": "nope", "next": "/dashboard"}, follow_redirects=False)
        assert wrong.status_code == 401 and "not this server's" in wrong.text
        assert guards.COOKIE not in browser.cookies
        signed = browser.post(guards.LOGIN_PATH, data={"key": KEY, "next": "/dashboard"}, follow_redirects=False)
        assert signed.status_code == 303 and signed.headers["location"] == "/dashboard"
        cookie = signed.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and KEY not in cookie
        assert browser.get("/dashboard").text == "<p>step 0</p>"
        with browser.websocket_connect("/dashboard/ws") as ws:  # the cookie opens the websocket too
            assert ws.receive_text() == "session"
        assert browser.post("/step").status_code == 200
    with TestClient(_app()) as browser:  # ?key= sets the cookie and leaves the key out of the address
        first = browser.get(f"/dashboard?key={KEY}&theme=dark", follow_redirects=False)
        assert first.status_code == 303 and first.headers["location"] == "/dashboard?theme=dark"
        assert browser.get("/dashboard").status_code == 200


def test_login_never_redirects_off_the_server():
    with TestClient(_app()) as client:
        for target in ("//evil.example/x", "http://evil.example/", "javascript:alert(1)"):
            reply = client.post(guards.LOGIN_PATH, data={"key": KEY, "next": target}, follow_redirects=False)
            assert reply.status_code == 303 and reply.headers["location"] == "/", target


def test_a_body_past_the_limit_is_refused_before_the_key_is_needed_only_when_signed_in():
    with TestClient(_app()) as client:
        big = b"x" * 20_000
        assert client.post("/step", content=big).status_code == 401  # no key: refused before the body is read
        reply = client.post("/step", content=big, headers={"authorization": f"Bearer {KEY}"})
        assert reply.status_code == 413 and "10000 bytes" in reply.json()["error"]["message"]


@pytest.mark.parametrize(
    "host, api_key, warns",
    [
        ("127.0.0.1", None, False),
        ("localhost", None, False),
        ("::1", None, False),
        ("[::1]", None, False),
        ("127.0.0.2", None, False),
        ("0.0.0.0", None, True),
        ("::", None, True),
        ("192.168.1.5", None, True),
        ("myhost.example", None, True),
        ("0.0.0.0", "k", False),
    ],
)
def test_serving_beyond_the_loopback_without_a_key_warns(host, api_key, warns):
    warning = guards.warn_if_exposed(host, api_key)
    assert (warning is not None) == warns
    if warns:
        assert host in warning and "anyone" in warning and "--api-key" in warning


def test_bad_guard_settings_are_refused_when_the_app_is_built():
    for kwargs, field in (
        ({"api_key": ""}, "api_key"),
        ({"api_key": None, "max_request_body_bytes": 0}, "max_request_body_bytes"),
    ):
        with pytest.raises(ValueError, match=field):
            guards.install(FastAPI(), **kwargs)
