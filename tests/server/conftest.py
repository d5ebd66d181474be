"""Servers for the HTTP tests: real uvicorn on a loopback port, in a thread with its own event loop.

The tiny Llama of the suite gets a tokenizer here (a byte-level BPE trained in
memory, ids below its 320-token vocabulary, ``</s>`` = its EOS id 2) and a chat
template, so text and chat requests work without the real model.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import openai
import pytest
import uvicorn

from asyncinfer import AsyncEngine
from asyncinfer.server import ModelSpec, ServerSettings, create_app, server_config
from tests.helpers import hold_swap_loads

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11 on

T = TypeVar("T")

# The tiny model's options in these tests: 512 KV blocks of 16 tokens, 512-token requests.
TINY_OPTIONS = {"kv_cache_memory": 4 * 1024 * 1024, "max_model_len": 512, "dtype": "float32", "device": "cpu"}
#: The API keys of the keyed servers the tests start (`trusting`, and the access tests' own).
KEYS = ("key-one", "key-two")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = ["Hello world! The quick brown fox jumps over the lazy dog.", "user assistant system",
           "What is the capital of France? Paris is.", "1, 2, 3, 4, 5, 6"] * 10


@pytest.fixture(scope="session")
def tiny_chat_model(tiny_models, tmp_path_factory) -> Path:
    """The suite's tiny Llama saved with a small BPE tokenizer and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    src, _ = tiny_models["llama"]
    path = tmp_path_factory.mktemp("tiny-chat")
    for item in src.iterdir():
        shutil.copy(item, path / item.name)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(_CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    assert fast.eos_token_id == 2 and len(fast) <= 320
    fast.save_pretrained(path)
    return path


class LiveServer:
    """An app served by uvicorn on 127.0.0.1 (a free port), in a thread running its own loop, as
    ``run_server`` serves it (under ``settings``' header deadline and connection cap), with uvicorn's
    ``http`` protocol ("auto", "h11" or "httptools")."""

    def __init__(self, app: Any, settings: ServerSettings | None = None, http: str = "auto") -> None:
        self.app = app
        self.server = uvicorn.Server(server_config(app, settings, host="127.0.0.1", port=0, log_level="warning",
                                                   http=http))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = ""

    def __enter__(self) -> Self:
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        assert not self.thread.is_alive(), "the server did not stop"

    @property
    def engine(self) -> AsyncEngine:
        return self.app.state.engine

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the server's loop (where its engine lives) and wait for it."""
        loop = self.engine.loop
        assert loop is not None
        return asyncio.run_coroutine_threadsafe(coro, loop).result(120)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until the engine holds no request and no KV block (a disconnect's abort has landed)."""
        deadline = time.monotonic() + timeout
        while self.engine.num_unfinished_requests or self.engine.kv_stats().used_blocks:
            if time.monotonic() > deadline:
                raise AssertionError(f"still busy: {self.engine.num_unfinished_requests} requests, "
                                     f"{self.engine.kv_stats()}")
            time.sleep(0.01)


@pytest.fixture(scope="session")
def server(tiny_chat_model, minilm_dir, tiny_models) -> Iterator[LiveServer]:
    """create_app over the tiny chat model ("tiny"), all-MiniLM-L6-v2 ("minilm") and a tiny
    Qwen2 without a tokenizer ("ids": token-id prompts, ``token_id:<n>`` logprob tokens)."""
    app = create_app([
        ModelSpec(str(tiny_chat_model), "tiny", TINY_OPTIONS),
        ModelSpec(str(minilm_dir), "minilm"),
        ModelSpec(str(tiny_models["qwen2"][0]), "ids", TINY_OPTIONS),
    ])
    with LiveServer(app) as live:
        yield live


@pytest.fixture(scope="session")
def client(server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def trusting(tiny_models):
    """A keyed server that takes its tenant and priority from a proxy's headers."""
    settings = ServerSettings(api_keys=KEYS, tenant_from="header", tenant_header="X-Team", priority_header="X-Priority")
    with LiveServer(create_app(ModelSpec(str(tiny_models["qwen2"][0]), "ids", TINY_OPTIONS), settings)) as live:
        yield live



@pytest.fixture(scope="module", params=["httptools", "h11"])
def per_parser(tiny_models, request) -> Iterator[LiveServer]:
    """A server of a tiny token-id model behind each of uvicorn's HTTP/1.1 parsers (``.parser`` names it): the
    raw-socket tests of the request-head limit (test_fresh_pass34, test_fresh_pass35)."""
    app = create_app(ModelSpec(str(tiny_models["qwen2"][0]), "ids", TINY_OPTIONS))
    with LiveServer(app, http=request.param) as server:
        server.parser = request.param  # type: ignore[attr-defined]
        yield server


def raw_answer(sock: socket.socket, quiet: float = 1.0) -> bytes:
    """What a server sends on a raw socket until it closes the connection (``<closed>`` appended) or resets it
    (``<reset>``: h11's own 400 closes with the rest of a head unread), or is quiet for ``quiet`` seconds (at most 10
    seconds in all)."""
    data = b""
    sock.settimeout(quiet)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            piece = sock.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            return data + b"<reset>"
        if not piece:
            return data + b"<closed>"
        data += piece
    return data


@contextlib.contextmanager
def held_drain_swap(live: LiveServer, model: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A drain-mode swap of the served model ``name`` to ``model``, held in its load: yields once ``name`` has left
    ``model_info()`` (between versions: no version serves it); on leaving, the load goes on and the swap is seen
    through (its result awaited unless the body raised)."""
    release = hold_swap_loads(monkeypatch)
    engine = live.engine
    assert engine.loop is not None
    swap = asyncio.run_coroutine_threadsafe(
        engine.swap_model(str(model), name=name, mode="drain", **TINY_OPTIONS), engine.loop
    )
    try:
        deadline = time.monotonic() + 30
        while any(info.name == name for info in engine.model_info()):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        yield
    finally:
        release.set()
    swap.result(60)


def own_routes_app(errors: list[BaseException]) -> Any:
    """A deployment's own app behind ``guard_app``: ``GET /group`` runs one task a member of ``errors`` in a task
    group, each raising its error (what a route calling the engine from a task group lets through); ``GET /stream``
    starts a streamed answer, then raises ``errors[0]`` (a fault once the answer has begun)."""
    import anyio
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    from asyncinfer.server import guard_app

    app = FastAPI()

    @app.get("/group")
    async def group() -> dict[str, str]:
        async def fail(exc: BaseException) -> None:
            raise exc

        async with anyio.create_task_group() as tasks:
            for exc in errors:
                tasks.start_soon(fail, exc)
        return {"ok": "yes"}

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def body():
            yield b"one\n"
            raise errors[0]

        return StreamingResponse(body())

    return guard_app(app)


@pytest.fixture(scope="module")
def generator_only(tiny_models) -> Iterator[LiveServer]:
    """As ``asyncinfer serve`` starts by default: one generator (the tiny Qwen2, "ids"), no embedding model."""
    with LiveServer(create_app(ModelSpec(str(tiny_models["qwen2"][0]), "ids", TINY_OPTIONS))) as live:
        yield live


@pytest.fixture(scope="module")
def encoder_only(minilm_dir) -> Iterator[LiveServer]:
    """A server of one sentence encoder ("minilm") and no generator."""
    with LiveServer(create_app(ModelSpec(str(minilm_dir), "minilm"))) as live:
        yield live
