"""Bulk in fields the server ignores is skipped by the body's decoder, never built: a body up to the size
limit full of it costs a scan of its bytes, so a caller sending such bodies cannot slow anyone else.

The decode is measured in memory allocated (tracemalloc's peak: what the decode builds, whatever the
machine's load), and one innocent caller's latency is compared alone and while two dozen such bodies
arrive (a stated factor and slack, generous for a loaded 2-core machine: before, 24 such bodies took
it from 0.4 s to 17 s).
"""

from __future__ import annotations

import statistics
import time
import tracemalloc
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import msgspec
import pytest

from asyncinfer.server.errors import APIError
from asyncinfer.server.protocol import (
    CHAT_BODY,
    COMPLETION_BODY,
    EMBEDDING_BODY,
    decode_json,
    parse_chat,
    parse_completion,
    parse_embedding,
)
from asyncinfer.server.settings import ServerSettings

LIMIT = ServerSettings().max_body_bytes
HEAD = b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"'
PARTS = b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": ['
MAX_PEAK = 256 * 1024  # bytes a decode may allocate: a few objects, never the bulk (~1.3M lists)


def bulk(size: int = LIMIT - 4096) -> bytes:
    """A JSON array of empty arrays, ``size`` bytes or a little under: ~1.3M containers at the limit."""
    count = (size - 2) // 3
    return b"[" + b",".join([b"[]"] * count) + b"]"


BULK = bulk()


def peak_bytes(work: Callable[[], Any]) -> tuple[Any, int]:
    """``work()``'s result (or the APIError it raised) and the most memory it held allocated at once."""
    tracemalloc.start()
    try:
        try:
            result: Any = work()
        except APIError as exc:
            result = exc
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


ACCEPTED = [  # bodies whose bulk is ignored: they parse, to the same request as without it
    ("store", HEAD + b'}], "store": ' + BULK + b"}"),
    ("prompt_cache_key", HEAD + b'}], "prompt_cache_key": ' + BULK + b"}"),
    ("a message's `name`", HEAD + b', "name": ' + BULK + b"}]}"),
    ("a message's unknown key", HEAD + b', "x": ' + BULK + b"}]}"),
    ("a content part's unknown key", PARTS + b'{"type": "text", "text": "hi", "cache_control": ' + BULK + b"}]}]}"),
]
REFUSED = [  # bodies refused for a field holding the bulk, naming it, without building it
    ("chat", "bulk", HEAD + b'}], "bulk": ' + BULK + b"}"),
    ("chat", "metadata", HEAD + b'}], "metadata": ' + BULK + b"}"),
    ("chat", "logit_bias", HEAD + b'}], "logit_bias": ' + BULK + b"}"),
    ("chat", "messages.[1]", HEAD + b"}, " + BULK + b"]}"),
    ("chat", "messages.[0].content.[0]", PARTS + BULK + b"]}]}"),
    ("text", "logit_bias", b'{"model": "tiny", "prompt": "hi", "logit_bias": ' + BULK + b"}"),
    ("text", "bulk", b'{"model": "tiny", "prompt": "hi", "bulk": ' + BULK + b"}"),
    ("embed", "bulk", b'{"model": "minilm", "input": "hi", "bulk": ' + BULK + b"}"),
]
PARSERS = {"chat": (CHAT_BODY, parse_chat), "text": (COMPLETION_BODY, parse_completion),
           "embed": (EMBEDDING_BODY, parse_embedding)}


def test_the_bulk_would_be_over_a_million_objects() -> None:
    """What the shaped decode avoids: the same bulk decoded whole (the old way) builds ~1.3M lists."""
    assert LIMIT - 8192 < len(BULK) < LIMIT
    assert len(msgspec.json.decode(BULK)) == (len(BULK) + 1) // 3 > 1_300_000


@pytest.mark.parametrize(("where", "raw"), ACCEPTED, ids=[a[0] for a in ACCEPTED])
def test_ignored_bulk_is_skipped_not_built(where: str, raw: bytes) -> None:
    assert len(raw) <= LIMIT
    request, peak = peak_bytes(lambda: parse_chat(decode_json(raw, CHAT_BODY)))
    assert not isinstance(request, APIError), request
    assert request.messages == [{"role": "user", "content": "hi"}]
    assert request.sampling == {"max_tokens": 2}
    assert peak < MAX_PEAK, f"{where}: the decode allocated {peak} bytes"


@pytest.mark.parametrize(("route", "param", "raw"), REFUSED, ids=[f"{r[0]}-{r[1]}" for r in REFUSED])
def test_bulk_in_a_refused_field_is_refused_unread(route: str, param: str, raw: bytes) -> None:
    shape, parse = PARSERS[route]
    error, peak = peak_bytes(lambda: parse(decode_json(raw, shape)))
    assert isinstance(error, APIError) and (error.status, error.param) == (400, param), error
    assert peak < MAX_PEAK, f"{route} {param}: the decode allocated {peak} bytes"


def test_an_innocent_caller_is_not_slowed_by_bodies_of_ignored_bulk(server) -> None:
    """24 bodies at the size limit, their bulk (1.3M tiny arrays) in `store` and in a message's `name` (both
    ignored), each parsed whole and refused only after (its model does not exist). The control: 24 bodies
    of the same size whose bulk is one string (as cheap to decode before as now), so that the upload of
    96 MiB through the same process weighs on both alike. The innocent's slowest chat answer while the
    bulk arrives stays within 3x its slowest during the control, plus 2 s (before: 17 s against 0.4 s
    alone, and bodies timed out with 408s)."""
    innocent = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "temperature": 0}
    text = b'"' + b"x" * (len(BULK) - 2) + b'"'
    control = [(HEAD + b'}], "store": ' + text + b"}").replace(b'"tiny"', b'"nope"'),
               (HEAD + b', "name": ' + text + b"}]}").replace(b'"tiny"', b'"nope"')]
    heavy = [(HEAD + b'}], "store": ' + BULK + b"}").replace(b'"tiny"', b'"nope"'),
             (HEAD + b', "name": ' + BULK + b"}]}").replace(b'"tiny"', b'"nope"')]
    assert [len(c) for c in control] == [len(h) for h in heavy]
    with httpx.Client(base_url=server.url, timeout=120) as http:

        def ask() -> float:
            start = time.perf_counter()
            r = http.post("/v1/chat/completions", json=innocent)
            assert r.status_code == 200, r.text
            return time.perf_counter() - start

        def under(bodies: list[bytes]) -> tuple[list[float], list[int]]:
            def send(i: int) -> int:
                with httpx.Client(base_url=server.url, timeout=300) as own:
                    return own.post("/v1/chat/completions", content=bodies[i % 2],
                                    headers={"content-type": "application/json"}).status_code

            with ThreadPoolExecutor(24) as pool:
                sent = [pool.submit(send, i) for i in range(24)]
                during = []
                while not all(f.done() for f in sent) or not during:
                    during.append(ask())
                return during, [f.result() for f in sent]

        ask()  # warm
        alone = statistics.median(ask() for _ in range(5))
        calm, calm_answers = under(control)
        during, answers = under(heavy)
    bound = 3 * max(calm) + 2.0
    assert max(during) <= bound, (f"alone {alone:.3f} s, control {[round(d, 3) for d in calm]}, "
                                  f"bulk {[round(d, 3) for d in during]} (bound {bound:.3f} s)")
    # each parsed whole: refused for its model, not its body (nor timed out, 408)
    assert answers == calm_answers == [404] * 24
