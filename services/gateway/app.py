"""The HTTP gateway's app: OpenAI-compatible videos, images and models, in front of the orchestrator.

    POST   /v1/videos                   submit a video job (JSON or multipart, `input_reference` as a file)
    GET    /v1/videos                   the caller's jobs, newest first
    GET    /v1/videos/{id}              a job as OpenAI's Video object (status, progress 0-100, error)
    GET    /v1/videos/{id}/content      the encoded video, streamed as the orchestrator sends it
    GET    /v1/videos/{id}/events       the job's progress as server-sent events, until it ends
    DELETE /v1/videos/{id}              cancel the job and delete it with its result
    POST   /v1/images/generations       `n` images, answered once made (b64_json)
    POST   /v1/images/edits             the same from input images (multipart `image`), for editing models
    GET    /v1/models                   the models the caller may use
    GET    /healthz, /readyz            the process is up; the orchestrator answers
    GET    /playground/                 the web playground (playground.py), unless --no-playground; / redirects there

A video job is the orchestrator's job: its id works with the gRPC API too (WatchJob, GetJob, CancelJob), and
the orchestrator's tenants, keys, quotas and durability apply unchanged. The gateway keeps no state of its own,
so any number of gateways may serve one orchestrator. Before a route runs, the key is checked (key_check.py)
and the body bounded (bodies.py); connections have deadlines (connections.py). The video routes are in
video_routes.py, the image routes in image_routes.py; models and health are here.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.gateway.bodies import BodyLimit
from services.gateway.downloads import DownloadSlots
from services.gateway.errors import ApiError, from_http_exception, from_stagediff_error, validation_error
from services.gateway.headers import AuthorizationCheck
from services.gateway.image_routes import image_routes
from services.gateway.key_check import OPEN_PATHS, KeyCheck, KeyFirst
from services.gateway.options import DEFAULT_MAX_DOWNLOADS_PER_KEY
from services.gateway.orchestrator import Orchestrator
from services.gateway.playground import SecurityHeaders, add_playground, is_playground_path
from services.gateway.schemas import model_object
from services.gateway.video_routes import video_routes
from services.launch_id import launch_id
from stagediff.errors import StageDiffError


def create_app(
    orchestrator: Orchestrator,
    *,
    max_body_bytes: int,
    image_wait_s: float,
    max_downloads_per_key: int = DEFAULT_MAX_DOWNLOADS_PER_KEY,
    openapi: bool = False,
    playground: bool = True,
) -> FastAPI:
    """The gateway's app. `openapi` serves /openapi.json (behind the key, as every route but /healthz, /readyz
    and the playground's files); there is no /docs page, whose script would come from a CDN. `playground` serves
    the web playground at /playground/."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await orchestrator.close()

    app = FastAPI(
        title="StageDiff HTTP gateway",
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json" if openapi else None,
        lifespan=lifespan,
    )
    app.state.orchestrator = orchestrator
    downloads = DownloadSlots(max_downloads_per_key)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return error.response()

    @app.exception_handler(StageDiffError)
    async def orchestrator_error(request: Request, error: StageDiffError) -> JSONResponse:
        return from_stagediff_error(error).response()

    @app.exception_handler(RequestValidationError)
    async def query_error(request: Request, error: RequestValidationError) -> JSONResponse:
        return validation_error(error.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return from_http_exception(error).response()

    # The last added runs first: a declared Content-Length over the limit is 413 before the key is checked, and
    # the key is checked before the route reads a byte of the body.
    def is_open(path: str) -> bool:
        return path in OPEN_PATHS or (playground and is_playground_path(path))

    app.add_middleware(KeyFirst, check=KeyCheck(orchestrator), is_open=is_open)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(AuthorizationCheck)  # before any body is read
    if playground:
        app.add_middleware(SecurityHeaders)  # the outermost: every answer on the playground's paths has them

    app.include_router(video_routes(orchestrator, downloads))
    app.include_router(image_routes(orchestrator, image_wait_s))
    if playground:
        add_playground(app)

    # ---------------------------------------------------------------- models --

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict:
        models = await orchestrator.list_models(request.headers.get("authorization"))
        return {"object": "list", "data": [model_object(model) for model in models]}

    # ---------------------------------------------------------------- health --

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        if await orchestrator.serving():
            # The id of this process where whoever started it gave one (services/launch_id.py).
            return JSONResponse({"status": "ready", **({"launch_id": launch_id()} if launch_id() else {})})
        message = f"the orchestrator at {orchestrator.endpoint} is not serving"
        return ApiError(503, message, type="service_unavailable_error", code="not_ready").response()

    return app
