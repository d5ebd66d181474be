"""An OpenAI-compatible HTTP layer over :class:`~asyncinfer.AsyncEngine` (``pip install 'asyncinfer[server]'``).

    from fastapi import Depends, FastAPI
    from asyncinfer.server import ServerSettings, guard_app, openai_router, require_api_key, run_server

    settings = ServerSettings(api_keys=("sk-one",))
    app = FastAPI(lifespan=...)              # start the engine in the lifespan
    app.include_router(openai_router(engine, settings))
    guard_app(app, settings)                 # OpenAI errors on every route, request ids, body deadline

    @app.get("/mine", dependencies=[Depends(require_api_key(settings))])   # your own route: the same key
    async def mine() -> dict: ...

    run_server(app, settings=settings)       # uvicorn, with the header deadline and the connection cap

or a whole app: ``create_app(ModelSpec("/models/llama", name="llama"))``, or from
the shell: ``asyncinfer serve MODEL --port 8000``. See docs/serving.md.
"""

from asyncinfer.server.app import create_app, guard_app, run_server, server_config
from asyncinfer.server.auth import require_api_key
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
    "require_api_key",
    "run_server",
    "server_config",
]
