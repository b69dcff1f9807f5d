"""The web playground: a page to try prompts on, served by the gateway at /playground/ (/ redirects there).

The page is static files, package data of services.gateway (playground/: index.html, app.js, style.css,
icon.svg), served by starlette's StaticFiles. It is plain HTML, CSS and JavaScript with no build step, and
self-contained: no script, style, font or image comes from another origin. In the browser it calls the gateway's
own routes with the API key the user types (kept in the tab's sessionStorage): /v1/models for the models and
what each takes, /v1/videos to submit, list and delete jobs, a job's events to show each stage's progress, its
content to play (fetched with the key into a blob: URL, since a <video src> sends no headers), and /v1/images
for the models that make images.

Rules:
- The files hold no data and no secret, so they are served without a key (`is_playground_path` is open in
  key_check.KeyFirst); every call the page makes is an API call, checked like any other client's.
- Every answer under these paths carries SECURITY_HEADERS: a Content-Security-Policy under which the page runs
  only its own files (no inline script or style: nothing injected into it runs), shows images and video only
  from itself or the blob: and data: URLs it makes, connects only to its own origin and is framed by nobody;
  and nosniff, so that no file is read as another type. tests/unit/test_playground.py checks both, and that
  the files name no other origin.
- The links are relative (the page calls ../v1/...; / redirects to playground/), so that the playground works
  behind a proxy that serves the gateway under a path prefix.
- `--no-playground` (options.py) leaves the paths unrouted: they are then answered as any unknown path.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

PLAYGROUND_PATH = "/playground"
# The folder of the page's files inside the services.gateway package.
FILES = ("services.gateway", "playground")
CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' blob: data:",
        "media-src 'self' blob:",
        "connect-src 'self'",
        "font-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    )
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    # The files change with the gateway's version: the browser asks again (and gets a 304 while they are the same).
    "Cache-Control": "no-cache",
}


def is_playground_path(path: str) -> bool:
    """Whether `path` is the playground's: its files, /playground itself, or / (which redirects to it)."""
    return path in ("/", PLAYGROUND_PATH) or path.startswith(PLAYGROUND_PATH + "/")


class SecurityHeaders:
    """ASGI middleware: every answer to a playground path carries SECURITY_HEADERS, whatever made it (a file, a
    redirect, a 404)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_playground_path(scope["path"]):
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(raw=list(message.get("headers", [])))
                for name, value in SECURITY_HEADERS.items():
                    headers[name] = value
                message["headers"] = headers.raw
            await send(message)

        await self.app(scope, receive, send_with_headers)


def add_playground(app: FastAPI) -> None:
    """Routes the playground's paths on `app` (the middleware, SecurityHeaders, is the caller's to add)."""

    async def to_the_page() -> RedirectResponse:
        # Relative: "/" and "/playground" both resolve it to /playground/, under any prefix a proxy adds.
        return RedirectResponse("playground/", status_code=307)

    app.add_api_route("/", to_the_page, methods=["GET", "HEAD"], include_in_schema=False)
    app.add_api_route(PLAYGROUND_PATH, to_the_page, methods=["GET", "HEAD"], include_in_schema=False)
    app.mount(PLAYGROUND_PATH, StaticFiles(packages=[FILES], html=True), name="playground")
