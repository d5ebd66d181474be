"""Pass 23: combinations of structured output, seeds, ``n > 1``, logprobs, stop strings and preemption.

Structured output needs a tokenizer, so these run on the HTTP tests' tiny chat model (float32: a row's
logits do not depend on its batch, docs/reliability.md "Seeded sampling depends on the request only").
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

from asyncinfer import AsyncEngine, SamplingParams, StructuredOutput
from tests.helpers import EngineOnLoop

from .conftest import TINY_OPTIONS

# 4-token blocks; the tiny Llama's KV is 512 bytes a token (2 layers x K,V x 2 heads x 16 dims x 4 bytes).
SMALL = {**TINY_OPTIONS, "block_size": 4, "max_model_len": 128}
TIGHT_KV = 40 * 4 * 512  # 40 blocks: samples of n > 1 and neighbours preempt each other

SPECS = {
    "regex": StructuredOutput.regex(r"[a-z ]{4,30}\."),
    "choice": StructuredOutput.choice(["Paris", "London", "Rome is far", "no"]),
    "json": StructuredOutput.json_schema({"type": "object", "properties": {"city": {"type": "string"},
                                          "n": {"type": "integer"}}, "required": ["city", "n"],
                                          "additionalProperties": False}),
    "lark": StructuredOutput.grammar('start: "x" ("y" | "zz")* "."'),
}


def params(kind: str, seed: int, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=24, temperature=1.3, top_p=0.97, seed=seed, n=n, logprobs=2,
                          stop=["ww", "o"] if kind == "regex" else None, structured=SPECS[kind])


PROMPT = "What is the capital of France? Paris is."


def tokens_of(out: Any) -> list[tuple[list[int], str, str | None]]:
    return [(o.token_ids, o.text, o.finish_reason) for o in out.outputs]


def test_seeded_structured_samples_with_logprobs_and_stops_are_the_same_alone_batched_and_preempted(
        tiny_chat_model: Path) -> None:
    """Each seed of each constrained request, asked alone on an idle engine without a prefix cache, gives the
    tokens, text, finish reason and logprobs that its ``n = 3`` form gives on 40 KV blocks beside random
    neighbours (preemption, prefix hits, chunked prefills, other grammars in the same steps)."""

    async def alone() -> dict[tuple[str, int], Any]:
        found = {}
        for kind in SPECS:
            for seed in (40, 41, 42):
                engine = AsyncEngine.from_pretrained(tiny_chat_model, **SMALL, enable_prefix_caching=False)
                async with engine:
                    found[kind, seed] = await engine.generate(PROMPT, params(kind, seed))
        return found

    async def together() -> tuple[dict[str, Any], Any, Any]:
        rng = random.Random(23)
        engine = AsyncEngine.from_pretrained(tiny_chat_model, **{**SMALL, "kv_cache_memory": TIGHT_KV},
                                             max_num_batched_tokens=24, max_num_seqs=12)
        async with engine:
            async def neighbour() -> Any:
                await asyncio.sleep(rng.random() * 0.01)
                kind = rng.choice([*SPECS, None, None])
                return await engine.generate(
                    [rng.randrange(5, 300) for _ in range(rng.randrange(3, 30))],
                    SamplingParams(max_tokens=rng.randrange(4, 30), temperature=rng.choice([0.0, 0.9]),
                                   n=rng.choice([1, 2]), logprobs=rng.choice([None, 3]),
                                   structured=SPECS[kind] if kind else None, ignore_eos=kind is None))

            load = [asyncio.ensure_future(neighbour()) for _ in range(16)]
            groups = {kind: asyncio.ensure_future(engine.generate(PROMPT, params(kind, 40, n=3))) for kind in SPECS}
            done = {kind: await g for kind, g in groups.items()}
            await asyncio.gather(*load)
            return done, engine.step_stats(), engine.kv_stats()

    ref = asyncio.run(alone())
    got, stats, kv = asyncio.run(together())
    assert stats.preemptions > 0 and kv.prefix_hits > 0  # the hard cases happened
    for kind in SPECS:
        expected = [tokens_of(ref[kind, 40 + i])[0] for i in range(3)]
        assert tokens_of(got[kind]) == expected, kind
        for i, sample in enumerate(got[kind].outputs):
            want = ref[kind, 40 + i].outputs[0].logprobs
            assert [(lp.token_id, [t for t, _ in lp.top]) for lp in sample.logprobs] == \
                [(lp.token_id, [t for t, _ in lp.top]) for lp in want], kind
            # the logprobs are the same up to float32 rounding (a prefill cut into other chunks sums in another order)
            assert [lp.logprob for lp in sample.logprobs] == pytest.approx([lp.logprob for lp in want], abs=1e-5), kind


# ---- any combination of parameters fails or serves its own request only ----------------------------------------

import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from asyncinfer.errors import AsyncInferError  # noqa: E402

NEIGHBOUR = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=1)
NEIGHBOUR_PROMPT = [7, 8, 9, 10, 11, 12]


@pytest.fixture(scope="module")
def shared(tiny_chat_model: Path) -> Iterator[tuple[EngineOnLoop, list[int], list[Any]]]:
    engine = EngineOnLoop(AsyncEngine.from_pretrained(tiny_chat_model, **{**SMALL, "kv_cache_memory": TIGHT_KV},
                                                    max_num_batched_tokens=24, max_num_seqs=12))
    alone = engine.call(engine.engine.generate(NEIGHBOUR_PROMPT, NEIGHBOUR))
    yield engine, alone.token_ids, alone.logprobs
    engine.close()


hostile_params = st.fixed_dictionaries({}, optional={
    "max_tokens": st.integers(1, 40),
    "temperature": st.sampled_from([0.0, 0.5, 1.0, 2.0, 1e4]),
    "top_k": st.sampled_from([-1, 0, 1, 5, 10_000]),
    "top_p": st.sampled_from([1e-9, 0.3, 1.0]),
    "min_p": st.sampled_from([0.0, 0.5, 1.0]),
    "repetition_penalty": st.sampled_from([0.01, 1.0, 100.0]),
    "presence_penalty": st.sampled_from([-2.0, 0.0, 2.0]),
    "frequency_penalty": st.sampled_from([-2.0, 0.0, 2.0]),
    "seed": st.one_of(st.none(), st.integers(0, 2**63 - 1)),
    "stop": st.one_of(st.none(), st.lists(st.sampled_from(["a", "e", " ", "\ufffd", "is", "x" * 50]), min_size=1,
                                          max_size=4)),
    "stop_token_ids": st.one_of(st.none(), st.lists(st.integers(0, 319), max_size=8)),
    "ignore_eos": st.booleans(),
    "logprobs": st.one_of(st.none(), st.integers(0, 20)),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "n": st.integers(1, 12),
    "truncate_output_to_model_len": st.booleans(),
    "structured": st.one_of(st.none(), st.sampled_from([*SPECS.values(), StructuredOutput.regex("(a)?"),
                                                        StructuredOutput.regex(r"a{0,3}"),
                                                        StructuredOutput.json_object()])),
})


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kw=hostile_params, min_tokens=st.integers(0, 40), prompt=st.sampled_from(
    [PROMPT, "hi", [3] * 100, list(range(3, 60)), [2, 2, 2]]))
def test_any_combination_of_parameters_serves_or_fails_its_own_request_only(shared, kw, min_tokens, prompt) -> None:
    """Random parameters within their ranges (structured specs with n > 1, seeds, logprobs, stops,
    min_tokens, extreme filters and penalties, a prompt that fills the context) beside a greedy neighbour on
    40 KV blocks: the request serves (``n`` samples of at most ``max_tokens``) or raises a typed error, streamed
    as whole (each sample's tokens, text and finish reason, where its sampling is seeded or greedy), the
    neighbour's tokens and logprobs are what it gets alone, and nothing is left behind."""
    engine, alone_tokens, alone_logprobs = shared
    kw.setdefault("max_tokens", 16)
    try:
        params = SamplingParams(**kw, min_tokens=min(min_tokens, kw["max_tokens"]))
    except AsyncInferError:
        return

    async def whole() -> Any:
        try:
            out = await engine.engine.generate(prompt, params)
        except AsyncInferError as exc:
            return type(exc)
        return {o.index: (o.token_ids, o.text, o.finish_reason) for o in out.outputs}

    async def streamed() -> Any:
        pieces: dict[int, tuple[list[int], str, str | None]] = {}
        try:
            async for delta in engine.engine.stream(prompt, params):
                tokens, text, _ = pieces.get(delta.index, ([], "", None))
                pieces[delta.index] = (tokens + delta.token_ids, text + delta.text, delta.finish_reason)
        except AsyncInferError as exc:
            return type(exc)
        return pieces

    async def run() -> tuple[Any, Any, Any]:
        neighbour = asyncio.ensure_future(engine.engine.generate(NEIGHBOUR_PROMPT, NEIGHBOUR))
        mine = await whole()
        return mine, await streamed(), await neighbour

    mine, mine_streamed, neighbour = engine.call(run())
    assert neighbour.token_ids == alone_tokens
    assert [[t for t, _ in lp.top] for lp in neighbour.logprobs] == [[t for t, _ in lp.top] for lp in alone_logprobs]
    if isinstance(mine, dict):
        assert sorted(mine) == list(range(params.n)) and all(len(t) <= params.max_tokens for t, _, _ in mine.values())
        if params.greedy or params.seed is not None:
            assert mine_streamed == mine
    else:
        assert mine_streamed is mine  # the same typed refusal
    assert engine.engine.num_unfinished_requests == 0
    assert engine.engine.kv_stats().used_blocks == 0


# ---- over HTTP: whole = streamed for constrained, seeded n > 1 with logprobs and stops ------------------------

import json  # noqa: E402

import httpx  # noqa: E402

HTTP_CONSTRAINTS = [
    {"guided_regex": r"[a-z ]{4,30}\.", "stop": ["o"]},
    {"guided_choice": ["Paris", "London", "Rome is far", "no"]},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}},
    {"guided_grammar": 'start: "x" ("y" | "zz")* "."'},
]


def _chat_choices(url: str, extra: dict[str, Any], stream: bool) -> list[tuple[str, str | None, list[Any]]]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 24, "temperature": 1.3, "seed": 99, "n": 3, "logprobs": True, "top_logprobs": 3,
            "stream": stream, **extra}
    with httpx.Client(base_url=url, timeout=60) as http:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
    if not stream:
        return [(c["message"]["content"], c["finish_reason"],
                 [(t["token"], [a["token"] for a in t["top_logprobs"]]) for t in c["logprobs"]["content"]])
                for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    got: dict[int, list[Any]] = {}
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                entry = got.setdefault(c["index"], ["", None, []])
                entry[0] += c["delta"].get("content") or ""
                entry[1] = c["finish_reason"] or entry[1]
                entry[2] += [(t["token"], [a["token"] for a in t["top_logprobs"]])
                             for t in (c["logprobs"] or {}).get("content") or []]
    return [tuple(got[i]) for i in sorted(got)]  # type: ignore[misc]


@pytest.mark.parametrize("extra", HTTP_CONSTRAINTS, ids=["regex+stop", "choice", "json_schema", "lark"])
def test_a_constrained_seeded_n3_chat_streams_what_it_answers_whole(server, extra) -> None:
    """The same seeded ``n = 3`` constrained chat, with logprobs (alternatives at OpenAI's -9999) and a stop
    string, gives each choice the same content, finish reason and alternatives whole and streamed, the second
    time while another caller's constrained requests asking 20 alternatives share its steps (its -9999
    alternatives changed with them: the other caller's ``top_logprobs`` showed in this caller's answer)."""
    async def noise() -> None:
        engine = server.engine
        constrained = StructuredOutput.regex("(x|y)+")  # a grammar of its own, 20 alternatives asked
        await asyncio.gather(*(engine.generate([5 + i] * 9, SamplingParams(max_tokens=200, logprobs=20,
                                                                          structured=constrained))
                               for i in range(4)))

    whole = _chat_choices(server.url, extra, stream=False)
    busy = asyncio.run_coroutine_threadsafe(noise(), server.engine.loop)
    while not server.engine.num_unfinished_requests:
        time.sleep(0.001)
    streamed = _chat_choices(server.url, extra, stream=True)
    assert not busy.done()  # the other caller's requests shared its steps
    busy.result(60)
    assert len(whole) == 3 and streamed == whole
    assert len({w[0] for w in whole}) > 1 or "guided_choice" in extra  # the seeds matter


# ---- a tenant's places come back however its calls end ----------------------------------------------------------

import contextlib  # noqa: E402
import socket  # noqa: E402

from asyncinfer.server import ModelSpec, ServerSettings, Tenant, create_app  # noqa: E402

from .conftest import LiveServer  # noqa: E402

CHAOS_KEY = "sk-chaos"


def _raw(port: int, body: dict[str, Any], *, route: str = "/v1/completions", cut: int | None = None,
         read: int = 0, pipeline: int = 1) -> None:
    """Send ``body`` (``pipeline`` times on one connection; only ``cut`` bytes of it when given), read ``read``
    bytes of the answer, then close the connection."""
    data = json.dumps(body).encode()
    head = (f"POST {route} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {CHAOS_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode()
    wire = (head + data) * pipeline
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(wire if cut is None else wire[:cut])
        got = b""
        while len(got) < read:
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk


LONG_STREAM = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 300, "ignore_eos": True, "stream": True}
ACTIONS: dict[str, Any] = {
    "stream, gone after its first bytes": lambda port: _raw(port, LONG_STREAM, read=1),
    "whole, gone before the answer": lambda port: _raw(port, {**LONG_STREAM, "stream": False}),
    "body cut short": lambda port: _raw(port, LONG_STREAM, cut=150),
    "two prompts, n=2, gone": lambda port: _raw(port, {**LONG_STREAM, "prompt": [[5, 6], [7, 8]], "n": 2}, read=1),
    "pipelined, gone": lambda port: _raw(port, LONG_STREAM, pipeline=3, read=1),
    "a bad parameter": lambda port: _raw(port, {**LONG_STREAM, "temperature": 9}, read=1),
    "a spec the library refuses": lambda port: _raw(port, {**LONG_STREAM, "guided_regex": "(("}, read=1),
    "a chat gone while its grammar compiles": lambda port: _raw(
        port, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40,
               "guided_json": {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(40)}}},
        route="/v1/chat/completions"),
    "a stream read whole": lambda port: _raw(port, {**LONG_STREAM, "max_tokens": 3}, read=10**9),
}


@pytest.fixture(scope="module")
def chaotic(tiny_chat_model: Path) -> Iterator[LiveServer]:
    settings = ServerSettings(tenants={CHAOS_KEY: Tenant("chaos")}, max_requests_per_tenant=4)
    options = {**TINY_OPTIONS, "max_num_seqs": 2}  # two seats: long calls hold the engine, the others wait
    with LiveServer(create_app(ModelSpec(str(tiny_chat_model), "tiny", options), settings)) as live:
        yield live


def _places_left(live: LiveServer) -> int | None:
    """How many places the tenant can take now: long calls sent on connections held open, one at a time, until
    one is refused (a 429) or 5 are in flight; then the connections close (their calls aborted). None where one of
    them ran to its end meanwhile (its place back, so no count)."""
    port = int(live.url.rsplit(":", 1)[1])
    body = json.dumps({**LONG_STREAM, "stream": False, "max_tokens": 500}).encode()
    wire = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {CHAOS_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    with contextlib.ExitStack() as stack:
        for opened in range(5):
            sock = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=30))
            sock.sendall(wire)
            deadline = time.monotonic() + 30
            while live.engine.num_unfinished_requests <= opened:  # in the engine (one seat: it waits there)
                sock.setblocking(False)
                try:
                    answer = sock.recv(65536)
                except BlockingIOError:
                    answer = b""
                sock.setblocking(True)
                if answer.startswith(b"HTTP/1.1 200 "):  # a long call ran to its end (a fast machine): its place
                    return None  # came back meanwhile, so this count is no count: the caller probes again
                if answer:
                    assert answer.startswith(b"HTTP/1.1 429 "), answer
                    return opened
                assert time.monotonic() < deadline, "a call neither ran nor was refused"
                time.sleep(0.005)
    return 5


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=st.lists(st.sampled_from(sorted(ACTIONS)), min_size=1, max_size=6))
def test_a_tenants_places_come_back_however_its_calls_end(chaotic, plan) -> None:
    """A tenant's calls that end every way a client can make them end (gone mid-stream, before a whole answer,
    in the middle of its body, with pipelined calls behind, refused, gone while its grammar compiles), several at
    once: once the engine is idle, the tenant holds no place and may again have its 4 requests in flight."""
    port = int(chaotic.url.rsplit(":", 1)[1])
    threads = [threading.Thread(target=ACTIONS[name], args=(port,)) for name in plan]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    chaotic.wait_idle(60)
    for _ in range(3):
        left = _places_left(chaotic)
        chaotic.wait_idle(60)
        if left is not None:
            break
    assert left == 4


# ---- what the router reads or makes with a tokenizer belongs to the version that runs the request ----------------

SWAP_OPTIONS = {"max_model_len": 256, "kv_cache_memory": 32 * 2**20}


def _swap_before_the_first_call(live: LiveServer, model: Path, method: str) -> list[dict[str, Any]]:
    """Make the engine's ``method`` (generate or stream) swap the model for ``model`` (another tokenizer and
    vocabulary) at its first call, before the request is bound: a swap landing between the router's reading
    of the serving version and the engine's binding. Returns the keywords of each call."""
    engine = live.engine
    real = getattr(engine, method)
    calls: list[dict[str, Any]] = []

    async def swapped_generate(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        if len(calls) == 1:
            await engine.swap_model(str(model), **SWAP_OPTIONS)
        return await real(*args, **kwargs)

    async def swapped_stream(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        if len(calls) == 1:
            await engine.swap_model(str(model), **SWAP_OPTIONS)
        async for delta in real(*args, **kwargs):
            yield delta

    setattr(engine, method, swapped_generate if method == "generate" else swapped_stream)
    return calls


def _sse(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize("case", ["completion logprobs", "two prompts logprobs", "chat logprobs",
                                  "completion stream usage"])
def test_a_swap_before_the_request_is_bound_runs_it_with_the_tokenizer_the_router_used(tiny_chat_model, real_gguf,
                                                                                      case) -> None:
    """The router reads the serving version's tokenizer to decode logprobs (and, for a stream's usage, to count a
    completion's prompt) before the engine binds the request; a swap that landed in between ran the request on
    the new version while the answer read its tokens with the old tokenizer: `"w122"` came with the tokens
    `["\\ufffd", "=", ">", ">"]` (and a stream's prompt ids, made by the old tokenizer, ran on the new model).
    Such calls are pinned to the version read, and made again for the new one."""
    with LiveServer(create_app(ModelSpec(str(tiny_chat_model), "m", TINY_OPTIONS))) as live:
        with httpx.Client(base_url=live.url, timeout=120) as http:
            if case == "completion logprobs":
                calls = _swap_before_the_first_call(live, real_gguf, "generate")
                r = http.post("/v1/completions", json={"model": "m", "prompt": "The capital of France is",
                                                       "max_tokens": 6, "temperature": 0, "logprobs": 2})
                assert r.status_code == 200, r.text
                choice = r.json()["choices"][0]
                tokens, text = choice["logprobs"]["tokens"], choice["text"]
            elif case == "two prompts logprobs":  # the first bound before the swap, the other after it
                calls = _swap_before_the_first_call(live, real_gguf, "generate")
                r = http.post("/v1/completions", json={"model": "m", "prompt": ["The capital of France is", "Hi"],
                                                       "max_tokens": 6, "temperature": 0, "logprobs": 2})
                assert r.status_code == 200, r.text
                choices = r.json()["choices"]
                tokens = [t for c in choices for t in c["logprobs"]["tokens"]]
                text = "".join(c["text"] for c in choices)
                assert len(calls) == 4
                calls = [calls[0], calls[2]]
            elif case == "chat logprobs":
                calls = _swap_before_the_first_call(live, real_gguf, "generate")
                r = http.post("/v1/chat/completions", json={
                    "model": "m", "messages": [{"role": "user", "content": "What is the capital of France?"}],
                    "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 2})
                assert r.status_code == 200, r.text
                choice = r.json()["choices"][0]
                tokens, text = [t["token"] for t in choice["logprobs"]["content"]], choice["message"]["content"]
            else:
                calls = _swap_before_the_first_call(live, real_gguf, "stream")
                r = http.post("/v1/completions", json={"model": "m", "prompt": "The capital of France is",
                                                       "max_tokens": 6, "temperature": 0, "stream": True,
                                                       "stream_options": {"include_usage": True}})
                assert r.status_code == 200, r.text
                chunks = _sse(r.text)
                text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
                ids = live.engine.get_tokenizer("m")("The capital of France is")["input_ids"]
                assert chunks[-1]["usage"]["prompt_tokens"] == len(ids)  # counted by the version that ran it
                alone = live.call(live.engine.generate(ids, SamplingParams(max_tokens=6)))
                tokens = [alone.text]  # and run with its own ids: the new model's greedy reply to them
        assert live.engine.model_info()[0].source.endswith(".gguf")
        assert "".join(tokens) == text and text  # the new model's tokens, read by its own tokenizer
        assert len(calls) == 2 and calls[0]["version_id"] != calls[1]["version_id"]  # made again for the new one
