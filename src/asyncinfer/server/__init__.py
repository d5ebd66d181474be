"""An OpenAI-compatible HTTP layer over :class:`~asyncinfer.AsyncEngine` (``pip install 'asyncinfer[server]'``).

    from fastapi import FastAPI
    from asyncinfer.server import guard_app, openai_router, run_server

    app = FastAPI(lifespan=...)              # start the engine in the lifespan
    app.include_router(openai_router(engine))
    guard_app(app)                           # OpenAI errors on every route, request ids, body deadline
    run_server(app)                          # uvicorn, with the header deadline and the connection cap

or a whole app: ``create_app(ModelSpec("/models/llama", name="llama"))``, or from
the shell: ``asyncinfer serve MODEL --port 8000``. See docs/serving.md.
"""

from asyncinfer.server.app import create_app, guard_app, run_server, server_config
from asyncinfer.server.errors import APIError
from asyncinfer.server.router import openai_router
from asyncinfer.server.settings import (
    API_KEYS_ENV,
    METRICS_KEYS_ENV,
    ModelSpec,
    ServerSettings,
    Tenant,
    api_keys_from_env,
    metrics_keys_from_env,
)

__all__ = [
    "API_KEYS_ENV",
    "METRICS_KEYS_ENV",
    "APIError",
    "ModelSpec",
    "ServerSettings",
    "Tenant",
    "api_keys_from_env",
    "create_app",
    "guard_app",
    "metrics_keys_from_env",
    "openai_router",
    "run_server",
    "server_config",
]
