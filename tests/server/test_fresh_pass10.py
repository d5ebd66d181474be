"""Adversarial pass 10 (a hostile tenant over HTTP): faults found on the HTTP side and fixed."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import httpx
import msgspec
import pytest

from asyncinfer.server import ModelSpec, ServerSettings, create_app
from asyncinfer.server.errors import APIError
from asyncinfer.server.protocol import CHAT_BODY, COMPLETION_BODY, decode_json, parse_chat, parse_completion

from .conftest import TINY_OPTIONS, LiveServer
from .test_fresh_pass8 import _exchange

COMPLETION = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2}'
H2C = b"Upgrade: h2c\r\nConnection: Upgrade, HTTP2-Settings\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"


def _post(body: bytes, key: str, extra: bytes = b"") -> bytes:
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer "
        + key.encode()
        + b"\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n"
        + extra
        + b"\r\n"
        + body
    )


def _statuses(answer: bytes) -> list[bytes]:
    return re.findall(rb"HTTP/1\.1 (\d{3}) ", answer)


@pytest.fixture(params=["h11", "httptools"])
def keyed(request, tiny_chat_model):
    """A server with the key ``sk-right``, on each HTTP parser; yields its port and the parser."""
    pytest.importorskip(request.param)
    settings = ServerSettings(api_keys=("sk-right",))
    app = create_app(ModelSpec(str(tiny_chat_model), "tiny", TINY_OPTIONS), settings)
    with LiveServer(app, settings, http=request.param) as live:
        yield int(live.url.rsplit(":", 1)[1]), request.param


# httptools (uvicorn's parser wherever it is installed, so `asyncinfer serve`'s) takes a request with `Upgrade` and
# `Connection: upgrade` (curl --http2 sends `Upgrade: h2c`) for a switch of protocol: the message ends with its head,
# and the parser stops. uvicorn, which makes no such switch but a WebSocket's, dropped what followed in the same read
# and parsed the next read as a new request. So a request hidden in the body of such a POST, sent a moment after its
# head, was served as a request of its own (the POST made with a wrong key, the smuggled one with another's), and
# one request on the wire had two answers: a proxy sharing the connection hands the second to the next caller.
def test_a_request_inside_an_upgrade_requests_body_is_no_request(keyed) -> None:
    smuggled = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-right\r\n\r\n"
    request = _post(smuggled, "sk-wrong", H2C)
    head = request[: -len(smuggled)]
    answer = _exchange(
        keyed[0],
        [(head, 0.3), (smuggled, 0.5), (b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 0)],
        timeout=20,
    )
    assert _statuses(answer) == [b"401", b"200"], answer  # was 401, 200 (the smuggled list of models), 200
    assert b'"object":"list"' not in answer and answer.endswith(b'{"status":"ok"}')


# Its own body never reached its app either (the app read an empty one: a 400 "not valid JSON" for a valid request),
# and a request pipelined behind it in the same read was never answered, nor was one behind a GET asking for an upgrade.
@pytest.mark.parametrize("method", ["POST", "GET"])
def test_a_request_asking_for_an_upgrade_is_served_as_plain_http_and_so_is_the_next(keyed, method) -> None:
    first = (
        _post(COMPLETION, "sk-right", H2C)
        if method == "POST"
        else b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-right\r\n" + H2C + b"\r\n"
    )
    answer = _exchange(
        keyed[0], [(first + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 0)], timeout=20
    )
    assert _statuses(answer) == [b"200", b"200"], answer  # POST: was 400 "not valid JSON"; GET: the /health unanswered
    assert (b'"object":"text_completion"' if method == "POST" else b'"object":"list"') in answer
    assert answer.endswith(b'{"status":"ok"}')


def test_an_upgrade_body_sent_in_pieces_is_read_whole(keyed) -> None:
    request = _post(COMPLETION, "sk-right", H2C)
    cut = len(request) - len(COMPLETION) // 2  # the head and half the body, then the rest
    answer = _exchange(
        keyed[0],
        [
            (request[:cut], 0.3),
            (request[cut:], 0.3),
            (b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 0),
        ],
        timeout=20,
    )
    assert _statuses(answer) == [b"200", b"200"], answer
    assert b'"object":"text_completion"' in answer


# A chunked body of such a request (which httptools skips unread) is refused by name, the connection then closed with
# what followed it unread: never a 400 "not valid JSON" for a body the server did not read, nor a chunk served as a
# request. (h11 reads such a body as HTTP says: there it is a 200.)
def test_a_chunked_upgrade_body_is_refused_and_nothing_after_it_is_read(keyed) -> None:
    smuggled = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-right\r\n\r\n"
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(COMPLETION), COMPLETION)
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer "
        b"sk-right\r\nTransfer-Encoding: chunked\r\n" + H2C + b"\r\n"
    )
    answer = _exchange(keyed[0], [(head, 0.3), (chunked, 0.3), (smuggled, 0.5)], timeout=20)
    if keyed[1] == "h11":  # the body read, the next request served
        assert _statuses(answer) == [b"200", b"200"], answer
        assert b'"object":"text_completion"' in answer and b'"object":"list"' in answer
        return
    assert _statuses(answer) == [b"400"], answer  # was 400 "not valid JSON", then the models list for the chunk
    assert b'"code":"unsupported_upgrade"' in answer and b"x-request-id: req-" in answer


# A CONNECT is an upgrade to httptools too: its answer (405: no route takes it) went out, and the next read was parsed
# as a request. Its tunnel's bytes are no requests: the connection closes after the answer, what followed unread.
# (h11 reads on after a CONNECT it refused, as HTTP allows: the client may send no tunnel bytes before a 2xx.)
def test_the_bytes_after_a_connect_are_never_served_as_requests(keyed) -> None:
    smuggled = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-right\r\n\r\n"
    connect = b"CONNECT /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-right\r\n\r\n"
    answer = _exchange(keyed[0], [(connect, 0.3), (smuggled, 0.5)], timeout=20)
    assert _statuses(answer) == ([b"405"] if keyed[1] == "httptools" else [b"405", b"200"]), answer


# httptools takes a body of any transfer coding that ends in chunked (`Transfer-Encoding: gzip, chunked`) and hands
# the app the chunks' bytes undecoded: a gzip body was answered "The request body is not valid JSON" (h11 refuses
# such a request as unparsable). A transfer coding the server does not decode is now named in the refusal (RFC 9112:
# 501), as a `Content-Encoding` is, and the connection serves on.
@pytest.mark.parametrize("coding", [b"gzip, chunked", b"deflate,chunked", b"x-custom , chunked"])
def test_a_transfer_coding_other_than_chunked_is_refused_by_name(keyed, coding) -> None:
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(COMPLETION), COMPLETION)
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer "
        b"sk-right\r\nTransfer-Encoding: " + coding + b"\r\n\r\n" + chunked
    )
    answer = _exchange(keyed[0], [(request, 0.3), (b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 0)])
    if keyed[1] == "h11":  # refused by the parser itself, the connection closed
        assert _statuses(answer) == [b"400"] and b'"code":"invalid_http_request"' in answer, answer
        return
    assert _statuses(answer) == [b"501", b"200"], answer  # was 400 "The request body is not valid JSON"
    error = msgspec.json.decode(answer.split(b"\r\n\r\n", 1)[1].split(b"HTTP/1.1", 1)[0])["error"]
    assert error["code"] == "unsupported_transfer_encoding" and coding.decode() in error["message"], error


def test_a_chunked_body_is_read_as_before(keyed) -> None:
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(COMPLETION), COMPLETION)
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer "
        b"sk-right\r\nTransfer-Encoding: Chunked\r\nConnection: close\r\n\r\n" + chunked
    )
    answer = _exchange(keyed[0], [(request, 0)])
    assert _statuses(answer) == [b"200"] and b'"object":"text_completion"' in answer, answer


# `best_of` was compared with `n` as it came: `true` and `1.0` equal 1, so they passed as `best_of: 1` where every
# other integer field refuses a boolean or a float by name.
@pytest.mark.parametrize("value", ["true", "1.0", '"1"'])
def test_best_of_of_another_type_is_a_400_naming_it(value) -> None:
    body = b'{"model": "tiny", "prompt": "hi", "best_of": ' + value.encode() + b"}"
    with pytest.raises(APIError) as refused:
        parse_completion(decode_json(body, COMPLETION_BODY))
    assert (refused.value.status, refused.value.param) == (400, "best_of")
    assert "must be an integer" in refused.value.message


def test_best_of_equal_to_n_is_still_accepted() -> None:
    body = b'{"model": "tiny", "prompt": "hi", "n": 2, "best_of": 2}'
    assert parse_completion(decode_json(body, COMPLETION_BODY)).n == 2


# A request with `Expect: 100-continue` answered before its body was asked for (a 401, a 413 by its Content-Length) got
# no `100 Continue`, so its client may send no body, as RFC 9110 allows; but the connection stayed open, waiting for
# that body, and said nothing of it: a next request on it was read as the body, and never answered (the connection
# closed header_timeout later). The answer now says `connection: close`, and the connection closes after it.
def test_an_expect_100_request_answered_before_its_body_closes_its_connection(keyed) -> None:
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer "
        b"sk-wrong\r\nExpect: 100-continue\r\nContent-Length: " + str(len(COMPLETION)).encode() + b"\r\n\r\n"
    )
    start = time.monotonic()
    answer = _exchange(keyed[0], [(head, 0.5), (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", 0)], timeout=20)
    assert _statuses(answer) == [b"401"], answer
    assert b"connection: close" in answer.lower() and b"100 Continue" not in answer
    assert time.monotonic() - start < 5  # closed after the answer, not header_timeout (10 s) later


def test_an_expect_100_request_that_reads_its_body_keeps_its_connection(keyed) -> None:
    request = _post(COMPLETION, "sk-right", b"Expect: 100-continue\r\n")
    head, body = request[: -len(COMPLETION)], COMPLETION
    answer = _exchange(
        keyed[0],
        [(head, 0.5), (body, 0.5), (b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 0)],
        timeout=20,
    )
    assert _statuses(answer) == [b"100", b"200", b"200"], answer
    assert answer.endswith(b'{"status":"ok"}')


# Bytes that are no HTTP request, pipelined behind a request in flight, were answered by httptools' protocol at once,
# its 400 written before the request's answer and the connection closed: the request in flight was never answered
# (aborted), and the 400 stood as its answer. The requests before the unparsable bytes are now answered first, as h11
# answers them; then the 400, and the connection closes.
@pytest.mark.parametrize("garbage", [b"GARBAGE GARBAGE\x00\r\n\r\n", b"GET / HTTP/1.1\r\nBad Header\r\n\r\n"])
def test_unparsable_bytes_behind_a_request_in_flight_are_refused_after_its_answer(keyed, garbage) -> None:
    body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 100, "ignore_eos": true}'
    answer = _exchange(keyed[0], [(_post(body, "sk-right") + garbage, 0)], timeout=20)
    assert _statuses(answer) == [b"200", b"400"], answer  # httptools: was [400], the completion never answered
    first, second = answer.split(b"HTTP/1.1 400 ", 1)
    assert b'"object":"text_completion"' in first and b'"code":"invalid_http_request"' in second


# The fields chat accepts and ignores (`store`, `service_tier`, `prompt_cache_key`, ...) are kept as their raw text and
# never read, so bytes in them that are not UTF-8 were never checked: such a body was answered 200 where the same bytes
# in any other field are a 400 naming it (docs/serving.md: "bytes that are not UTF-8 anywhere in it").
@pytest.mark.parametrize("field", ["store", "service_tier", "prompt_cache_key", "reasoning_effort", "verbosity"])
@pytest.mark.parametrize("value", [b'"\xff"', b'["ok", "\xc3"]', b'{"k": "\xed\xa0\x80"}'])
def test_invalid_utf8_in_an_ignored_field_is_a_400_naming_it(field, value) -> None:
    body = b'{"messages": [{"role": "user", "content": "hi"}], "' + field.encode() + b'": ' + value + b"}"
    with pytest.raises(APIError) as refused:
        parse_chat(decode_json(body, CHAT_BODY))
    assert (refused.value.status, refused.value.param) == (400, field)
    assert "invalid UTF-8" in refused.value.message


def test_valid_text_in_an_ignored_field_is_still_ignored() -> None:
    body = '{"messages": [{"role": "user", "content": "hi"}], "store": true, "service_tier": "é 🙂"}'.encode()
    assert parse_chat(decode_json(body, CHAT_BODY)).messages == [{"role": "user", "content": "hi"}]


# A key given twice is read as its last copy (as Python's json reads it), and the first copy of a field kept as raw text
# (`messages`, `metadata`, a neutral or an ignored field) was dropped unread: its bytes, UTF-8 or not, never checked.
_HI = b'"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1'
FIRST_COPIES = [
    b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff"}], ' + _HI + b"}",
    b'{"model": "tiny", ' + _HI + b', "metadata": {"a": "\xff"}, "metadata": null}',
    b'{"model": "tiny", ' + _HI + b', "logit_bias": "\xff", "logit_bias": null}',
]


@pytest.mark.parametrize("body", FIRST_COPIES)
def test_invalid_utf8_in_a_first_copy_of_a_key_is_a_400_over_http(server, body) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        answer = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert answer.status_code == 400, answer.text  # was 200
        error = answer.json()["error"]
        assert error["type"] == "invalid_request_error" and "UTF-8" in error["message"], error
        assert answer.headers["x-request-id"].startswith("chatcmpl-")
        ok = client.post(
            "/v1/chat/completions", content=body.replace(b"\xff", b"x"), headers={"content-type": "application/json"}
        )
        assert ok.status_code == 200, ok.text


# uvicorn's h11 protocol (the parser wherever httptools is not installed: asyncinfer asks for plain uvicorn) handled every
# h11 event of a read in one go, and a body sent in chunks of one byte is an event a byte, some 16 microseconds of
# Python each: a megabyte of body held the loop for seconds at a time (2.9 s measured), every other caller's answers
# waiting. It now handles H11_EVENTS_PER_TURN of them a turn.
def test_a_body_in_one_byte_chunks_holds_the_loop_only_briefly_under_h11(tiny_chat_model) -> None:
    app = create_app(ModelSpec(str(tiny_chat_model), "tiny", TINY_OPTIONS))
    payload = b'{"model": "tiny", "prompt": "hi", "max_tokens": 1, "user": "' + b"u" * 400_000 + b'"}'
    wire = b"".join(b"1\r\n" + payload[i : i + 1] + b"\r\n" for i in range(len(payload))) + b"0\r\n\r\n"
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
    )
    # How long the server's loop is held, measured on that loop: a tick every 5 ms, each late by the time the loop was
    # held (a client probing /health from this process measured the GIL it shares with the server's thread instead:
    # on a fast machine its first probe came after the whole body).
    lags: list[float] = []
    done = threading.Event()

    async def ticks() -> None:
        while not done.is_set():
            start = time.monotonic()
            await asyncio.sleep(0.005)
            lags.append(time.monotonic() - start - 0.005)

    with LiveServer(app, http="h11") as live:
        port = int(live.url.rsplit(":", 1)[1])
        loop = live.engine.loop
        assert loop is not None
        ticking = asyncio.run_coroutine_threadsafe(ticks(), loop)
        try:
            answer = _exchange(port, [(head + b"Connection: close\r\n\r\n" + wire, 0)], timeout=60)
        finally:
            done.set()
            ticking.result(10)
    assert _statuses(answer) == [b"200"], answer[:300]
    assert len(lags) > 10 and max(lags) < 0.25, (len(lags), max(lags))  # was 2.9 s for a megabyte


# The authority form proxy clients send (`CONNECT host:port`): httptools refuses it in its parser, before any route
# is looked at (the 400 invalid_http_request in OpenAI's shape, the connection closed, the tunnel's bytes unread);
# h11 hands it to the app, which names no route for it (404), and reads on (no 2xx: no tunnel).
def test_a_connect_in_authority_form_is_answered_in_openai_s_shape(keyed) -> None:
    smuggled = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-right\r\n\r\n"
    connect = b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n"
    answer = _exchange(keyed[0], [(connect, 0.3), (smuggled, 0.5)], timeout=20)
    if keyed[1] == "h11":
        assert _statuses(answer) == [b"404", b"200"], answer
        assert b'"type":"invalid_request_error"' in answer and b"x-request-id: req-" in answer, answer
        return
    assert _statuses(answer) == [b"400"], answer
    assert b'"code":"invalid_http_request"' in answer and b"x-request-id: " in answer, answer


# `OPTIONS *` (the server-wide form) names the target as sent: its 404 read "No route OPTIONS /* on this server".
def test_the_asterisk_form_is_named_as_sent(keyed) -> None:
    answer = _exchange(keyed[0], [(b"OPTIONS * HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 0.3)], timeout=20)
    assert _statuses(answer) == [b"404"], answer
    assert b"No route OPTIONS * on this server" in answer and b"x-request-id: req-" in answer, answer
