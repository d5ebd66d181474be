"""Your own FastAPI app with the OpenAI routes in it: one engine in the lifespan, one route of yours.

    python examples/openai_server.py --host 127.0.0.1 --port 8000      # the default model; --model PATH for another
    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \
        -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64}'

The model is served under the name ``asyncinfer serve`` gives it: SmolLM2-135M-Instruct for the
default model, else its file's or directory's name (``--served-model-name`` chooses another).
As docs/guides/fastapi.md advises, the model loads in the lifespan with ``await AsyncEngine.load()``
(off the event loop), and only public names are used (docs/api.md, docs/serving.md).
``uvicorn openai_server:app`` (from examples/) serves it too, with the default model and without
``run_server``'s header deadline and connection cap (docs/serving.md, "Limits").
"""

import argparse
import socket
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI

from asyncinfer import AsyncEngine, AsyncInferError, SamplingParams
from asyncinfer.server import (
    ModelSpec,
    ServerSettings,
    api_keys_from_env,
    guard_app,
    metrics_keys_from_env,
    openai_router,
    require_api_key,
    run_server,
)

parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
parser.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M-Instruct)")
parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
parser.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default: 8000)")
parser.add_argument("--served-model-name", default=None, help="its name in requests (default: as asyncinfer serve)")
args = parser.parse_args(None if __name__ == "__main__" else [])  # `uvicorn openai_server:app`: its argv is uvicorn's
if not 0 <= args.port <= 65535:  # socket.bind's own refusal is an OverflowError
    parser.error(f"--port {args.port} is not a TCP port (0 to 65535)")
if args.served_model_name is not None and not 0 < len(args.served_model_name) <= 200:  # "$UNSET" is not "not given"
    parser.error(f"--served-model-name {args.served_model_name[:40]!r} is invalid: allowed a non-empty string of at "
                 "most 200 characters")
engine: AsyncEngine | None = None  # loaded in the lifespan


@asynccontextmanager
async def lifespan(app: FastAPI):
    global engine
    name = ModelSpec.served_name(args.model) if args.served_model_name is None else args.served_model_name
    engine = await AsyncEngine.load(args.model, name=name)
    async with engine:  # started on uvicorn's loop; in-flight requests finish at shutdown
        yield


# The keys in ASYNCINFER_API_KEY and ASYNCINFER_METRICS_KEY (/metrics), as `asyncinfer serve` reads them
# (ServerSettings() alone reads neither); tenants, limits: docs/serving.md
try:
    settings = ServerSettings(api_keys=api_keys_from_env(), metrics_keys=metrics_keys_from_env())
except AsyncInferError as exc:  # a blank or malformed key variable (ASYNCINFER_API_KEY=" "): one line, not a traceback
    parser.exit(2, f"{parser.prog}: error: {exc}\n")
app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
app.include_router(openai_router(lambda: engine, settings))  # the engine of the moment: /v1/chat/completions, ...
guard_app(app, settings)  # OpenAI errors on every route (404, 405, ...), request ids, the body deadline


# Your own routes ask for the same key as the router's (a 401 in OpenAI's shape without it)
@app.get("/haiku", dependencies=[Depends(require_api_key(settings))])
async def haiku(topic: str = "autumn") -> dict:
    out = await engine.generate([{"role": "user", "content": f"A haiku about {topic}."}], SamplingParams(max_tokens=48))
    return {"haiku": out.text}


if __name__ == "__main__":
    # Bound before the model loads, as `asyncinfer serve` does: a port in use is refused at once.
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
        sock.listen(2048)
    except OSError as exc:
        parser.exit(2, f"{parser.prog}: error: cannot listen on {args.host}:{args.port} ({exc.strerror}): stop the "
                       "server there, or choose another --host / --port\n")
    # uvicorn names no URL for a socket handed to it: say where it will serve.
    print(f"{parser.prog}: loading, then serving at http://{args.host}:{sock.getsockname()[1]}/v1", flush=True)
    try:
        run_server(app, args.host, args.port, settings=settings, sock=sock)  # with the header deadline and connection cap
    except AsyncInferError as exc:  # the model failed to load in the lifespan (a wrong --model): one line, not a traceback
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
