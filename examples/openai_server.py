"""Your own FastAPI app with the OpenAI routes in it: one engine in the lifespan, one route of yours.

    python examples/openai_server.py --host 127.0.0.1 --port 8000      # the default model; --model PATH for another
    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \
        -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}]}'

The model is served under the name ``asyncinfer serve`` gives it: SmolLM2-135M-Instruct for the
default model, else its file's or directory's name (``--served-model-name`` chooses another).
"""

import argparse
from contextlib import asynccontextmanager

from fastapi import FastAPI

from asyncinfer import AsyncEngine, SamplingParams
from asyncinfer.commands import CommandError
from asyncinfer.commands.serve import check_port_free
from asyncinfer.server import ModelSpec, ServerSettings, guard_app, openai_router, run_server

parser = argparse.ArgumentParser()
parser.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M-Instruct)")
parser.add_argument("--host", default="127.0.0.1")
parser.add_argument("--port", type=int, default=8000)
parser.add_argument("--served-model-name", default=None, help="its name in requests (default: as asyncinfer serve)")
args = parser.parse_args()
try:
    check_port_free(args.host, args.port)  # as `asyncinfer serve`: a port in use is refused before the model loads
except CommandError as exc:
    parser.exit(2, f"{parser.prog}: error: {exc}\n")

engine = AsyncEngine.from_pretrained(args.model, name=args.served_model_name or ModelSpec.served_name(args.model))


@asynccontextmanager
async def lifespan(app: FastAPI):
    async with engine:  # started on uvicorn's loop; in-flight requests finish at shutdown
        yield


settings = ServerSettings()  # keys, tenants, limits: docs/serving.md
app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
app.include_router(openai_router(engine, settings))  # /v1/chat/completions, /v1/completions, /v1/models, /health, ...
guard_app(app, settings)  # OpenAI errors on every route (404, 405, ...), request ids, the body deadline


@app.get("/haiku")
async def haiku(topic: str = "autumn") -> dict:
    out = await engine.generate([{"role": "user", "content": f"A haiku about {topic}."}], SamplingParams(max_tokens=48))
    return {"haiku": out.text}


if __name__ == "__main__":
    run_server(app, args.host, args.port, settings=settings)  # with the header deadline and the connection cap
