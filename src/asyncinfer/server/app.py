"""``create_app``: a whole OpenAI-compatible server around one engine, and ``run_server`` for uvicorn.

One process, one engine, one copy of each model, many concurrent requests: the
app's lifespan loads (or takes) the engine, starts it on the serving loop, adds
any further models, and closes it at shutdown.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import FastAPI

from asyncinfer.engine import AsyncEngine, EngineState
from asyncinfer.errors import EngineClosedError
from asyncinfer.server.router import openai_router
from asyncinfer.server.settings import ModelSpec, ServerSettings, model_specs


class _EngineSlot:
    """The engine the lifespan set up; asking before it is there is a 503 (still starting)."""

    def __init__(self) -> None:
        self.engine: AsyncEngine | None = None

    def __call__(self) -> AsyncEngine:
        if self.engine is None:
            raise EngineClosedError("the server is starting or stopping")
        return self.engine


def create_app(
    engine_or_models: AsyncEngine | ModelSpec | Sequence[ModelSpec] | None = None,
    settings: ServerSettings | None = None,
    **fastapi_options: Any,
) -> FastAPI:
    """A FastAPI app serving the OpenAI routes of :func:`openai_router` over one engine.

    ``engine_or_models``: an :class:`AsyncEngine` not started yet (the app starts it on
    its loop and closes it at shutdown; a running one is used and left running), or
    the models to load at start-up: a :class:`ModelSpec` or a list of them (the first
    builds the engine, the others are added with ``add_model``). ``None`` serves the
    default model. ``fastapi_options`` go to ``FastAPI(...)``.
    """
    slot = _EngineSlot()
    specs = () if isinstance(engine_or_models, AsyncEngine) else model_specs(
        ModelSpec(None, ModelSpec.served_name(None)) if engine_or_models is None else engine_or_models)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if isinstance(engine_or_models, AsyncEngine):
            engine, owned = engine_or_models, engine_or_models.state is EngineState.CREATED
        else:
            first = specs[0]
            engine = await anyio.to_thread.run_sync(
                lambda: AsyncEngine.from_pretrained(first.model, name=first.name, **first.options))
            owned = True
        if owned:
            await engine.start()
        try:
            for spec in specs[1:]:
                await engine.add_model(spec.name, spec.model, **spec.options)
            slot.engine = app.state.engine = engine
            yield
        finally:
            slot.engine = None
            if owned:
                await engine.aclose(abort=True)  # uvicorn has already let the requests in flight finish

    app = FastAPI(**{"title": "asyncinfer", "lifespan": lifespan, **fastapi_options})
    app.include_router(openai_router(slot, settings))
    return app


def run_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve ``app`` with uvicorn until interrupted."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level)
