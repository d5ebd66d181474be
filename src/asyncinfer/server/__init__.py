"""An OpenAI-compatible HTTP layer over :class:`~asyncinfer.AsyncEngine` (``pip install 'asyncinfer[server]'``).

    from fastapi import FastAPI
    from asyncinfer.server import openai_router

    app = FastAPI(lifespan=...)              # start the engine in the lifespan
    app.include_router(openai_router(engine))

or a whole app: ``create_app(ModelSpec("/models/llama", name="llama"))``, or from
the shell: ``asyncinfer serve MODEL --port 8000``. See docs/serving.md.
"""

from asyncinfer.server.app import create_app, run_server
from asyncinfer.server.errors import APIError
from asyncinfer.server.router import openai_router
from asyncinfer.server.settings import API_KEYS_ENV, ModelSpec, ServerSettings, api_keys_from_env

__all__ = [
    "API_KEYS_ENV",
    "APIError",
    "ModelSpec",
    "ServerSettings",
    "api_keys_from_env",
    "create_app",
    "openai_router",
    "run_server",
]
