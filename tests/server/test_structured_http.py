"""Structured output over HTTP: ``response_format``, vLLM's ``guided_*``, and function tools, with the official client.

Bad specs (against the tiny model's server) are 400s naming the body field, and the server serves on. The
real default model (SmolLM2-135M) shows the constraints work end to end: a JSON schema's replies validate,
``chat.completions.parse`` fills a Pydantic model, tool calls round-trip, streamed calls equal whole ones.
"""

from __future__ import annotations

import json
import logging
import re
from unittest.mock import ANY

import httpx
import jsonschema
import openai
import pydantic
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from asyncinfer import SamplingParams, StructuredOutput
from asyncinfer.server import ModelSpec, create_app
from asyncinfer.server.responses import Reply
from asyncinfer.server.tools import OPEN, CallStream, parse_tool_use, read_calls, split_calls
from tests.helpers import gather_tool_deltas

from .conftest import LiveServer

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
CHAT = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}
TEXT = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 4}
UNSAT = {"type": "string", "minLength": 5, "maxLength": 2}  # a well-formed schema no string satisfies
ROLL = {"type": "function", "function": {
    "name": "roll_dice", "description": "Roll dice and return the faces.",
    "parameters": {"type": "object", "properties": {
        "count": {"type": "integer", "minimum": 1, "maximum": 10},
        "sides": {"type": "integer", "enum": [4, 6, 8, 10, 12, 20]}},
        "required": ["count", "sides"], "additionalProperties": False}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False}}}


def _schema(schema, name="p"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


# (route, changes to a valid body, the param the 400 names)
BAD = [
    ("chat", {"response_format": "json"}, "response_format"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("chat", {"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema"),
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema.name"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {}, "strict": 1}}},
     "response_format.json_schema.strict"),
    ("chat", {"response_format": _schema([1])}, "response_format.json_schema.schema"),
    ("chat", {"response_format": _schema({"enum": ["x" * 70000]})},
     "response_format.json_schema.schema"),  # over MAX_SPEC_CHARS: refused by its shape
    ("chat", {"response_format": _schema(UNSAT)}, "response_format.json_schema.schema"),  # by the grammar library
    ("chat", {"response_format": _schema(UNSAT), "stream": True}, "response_format.json_schema.schema"),
    ("chat", {"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "response_format"),
    ("chat", {"guided_regex": "a("}, "guided_regex"),
    ("chat", {"guided_regex": 5}, "guided_regex"),
    ("chat", {"guided_choice": []}, "guided_choice"),
    ("chat", {"guided_json": UNSAT}, "guided_json"),
    ("chat", {"guided_json": {"type": "object"}, "guided_choice": ["a"]}, "guided_choice"),
    ("chat", {"guided_choice": ["a"], "guided_json": {"type": "object"}}, "guided_choice"),  # not the body's order
    ("chat", {"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"guided_choice": ["a"], "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}}, "response_format.json_schema.schema"),
    ("text", {"guided_grammar": "root ::= ("}, "guided_grammar"),
    ("text", {"guided_grammar": "root ::= (", "stream": True}, "guided_grammar"),
    ("text", {"response_format": {"type": "json_object"}}, "response_format"),  # not a completions field
    ("chat", {"tools": {"name": "f"}}, "tools"),
    ("chat", {"tools": [{"type": "function"}]}, "tools.[0]"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools.[0].function.name"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": 5}}]},
     "tools.[0].function.parameters"),
    ("chat", {"tools": [ROLL, ROLL]}, "tools"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": UNSAT}}], "tool_choice": "required"},
     "tools"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"tools": [ROLL], "tool_choice": "always"}, "tool_choice"),
    ("chat", {"tools": [ROLL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     "tool_choice"),
    ("chat", {"tools": [ROLL], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tools"),
    ("chat", {"tools": [ROLL], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ("chat", {"messages": [{"role": "tool", "content": "4"}]}, "messages.[0].tool_call_id"),
    ("chat", {"messages": [{"role": "assistant", "content": None, "tool_calls": "f()"}]}, "messages.[0].tool_calls"),
    ("chat", {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {
        "name": "f", "arguments": "{not json"}}]}]}, "messages.[0].tool_calls.[0].function.arguments"),
    ("chat", {"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "messages.[0].tool_calls"),
]
ROUTES = {"chat": ("/v1/chat/completions", CHAT), "text": ("/v1/completions", TEXT)}


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.mark.parametrize(("route", "changes", "param"), BAD, ids=[f"{r}-{p}" for r, _c, p in BAD])
def test_a_bad_spec_is_a_400_naming_its_field_and_the_server_serves_on(server, http, route, changes, param) -> None:
    path, valid = ROUTES[route]
    r = http.post(path, json={**valid, **changes})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error
    assert "Traceback" not in error["message"]
    assert http.post(path, json=valid).status_code == 200
    server.wait_idle()


def test_a_json_schema_that_is_no_object_is_told_what_it_needs(http) -> None:
    """``json_schema: "x"`` was told the object needs a ``name`` and a ``schema``, where a missing ``schema`` is taken
    (OpenAI's is optional: any JSON object)."""
    path, valid = ROUTES["chat"]
    r = http.post(path, json={**valid, "response_format": {"type": "json_schema", "json_schema": "x"}})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == ("`response_format.json_schema` must be an object with a `name` (and a "
                                            "`schema`, a JSON schema; without one, any JSON object).")


LEXER_BOMB = "a{1000}{1000}"  # compiles, then the library's lexer gives up at the first token (too many states)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_spec_the_library_gives_up_on_mid_way_is_a_400_not_a_500(server, http, stream, caplog) -> None:
    """It was a 500 `internal_error` (the request failed with the library's ValueError and its whole state
    dump): now the request's InvalidParameterError naming the body field, and the engine serves on. The
    caller's own input is logged as one warning line, never an error with a traceback (a caller sending
    many could fill the log)."""
    from asyncinfer.errors import InvalidParameterError, RequestFailedError

    with caplog.at_level(logging.WARNING), pytest.raises(RequestFailedError) as failed:
        server.call(server.engine.generate("a", SamplingParams(
            max_tokens=4, structured=StructuredOutput.regex(LEXER_BOMB)), model="tiny"))
    logged = [r for r in caplog.records if "fails alone" in r.getMessage()]
    assert logged and all(r.levelno == logging.WARNING and not r.exc_info for r in logged), logged
    cause = failed.value.__cause__
    assert isinstance(cause, InvalidParameterError) and cause.parameter == "structured"
    assert "within its limits" in cause.allowed and "<state>" not in str(failed.value)
    r = http.post("/v1/completions", json={**TEXT, "guided_regex": LEXER_BOMB, "stream": stream})
    assert r.status_code == 400, r.text  # a stream too: it fails at its first token, before the 200
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "guided_regex"), error
    assert "within its limits" in error["message"] and len(error["message"]) < 1000
    assert http.post("/v1/completions", json=TEXT).status_code == 200
    server.wait_idle()


def test_guided_choice_and_regex_hold_on_the_tiny_model(server, client) -> None:
    """Even a random model's replies follow the constraint; the engine's own spec gives the same tokens."""
    got = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0,
                                         extra_body={"guided_choice": ["yes", "no", "maybe"]})
    want = server.call(server.engine.generate(MESSAGES, SamplingParams(
        max_tokens=8, structured=StructuredOutput.choice(["yes", "no", "maybe"])), model="tiny"))
    assert (got.choices[0].message.content, got.choices[0].finish_reason) == (want.text, "stop")
    assert want.text in ("yes", "no", "maybe")
    text = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=12, temperature=0.8,
                                     seed=3, n=3, extra_body={"guided_regex": "[0-9]{3}-[a-c]{2}"})
    for choice in text.choices:
        assert choice.finish_reason == "stop" and re.fullmatch("[0-9]{3}-[a-c]{2}", choice.text), choice


def test_tool_choice_none_and_text_format_leave_the_request_as_it_was(server, client) -> None:
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0)
    same = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0,
                                          tools=[ROLL], tool_choice="none", response_format={"type": "text"})
    assert same.choices[0].message.content == plain.choices[0].message.content
    assert same.choices[0].message.tool_calls is None
    assert same.usage.prompt_tokens == plain.usage.prompt_tokens  # no tool was described to the model


# ---------------------------------------------------------------- the parser, on its own
def test_split_calls_reads_hermes_blocks_and_leaves_anything_else_as_content() -> None:
    use = parse_tool_use([ROLL, WEATHER], "auto", None)
    one = '<tool_call>\n{"name": "roll_dice", "arguments": {"count": 2, "sides": 6}}\n</tool_call>'
    two = one + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = split_calls("Let me roll. " + two, use)
    assert content == "Let me roll. "
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "roll_dice", {"count": 2, "sides": 6}), ("function", "get_weather", {"city": "Oslo"})]
    assert len({c["id"] for c in calls}) == 2 and all(c["id"].startswith("call_") for c in calls)
    assert split_calls(one, use)[0] is None
    assert len(split_calls(two, parse_tool_use([ROLL, WEATHER], "auto", False))[1]) == 1  # one call at most
    for text in ("no call here", one.replace("roll_dice", "rm_rf"), one[:-3], "<tool_call>{oops}</tool_call>",
                 '<tool_call>{"name": "roll_dice", "arguments": [2]}</tool_call>'):
        assert split_calls(text, use) == (text, []), text


DICE_CALL = '<tool_call>\n{"name": "roll_dice", "arguments": {"count": 2, "sides": 6}}\n</tool_call>'
OSLO_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
#: A call whose argument holds the closing tag: only a constrained stream can tell it from the block's end.
CITY_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo}\\n</tool_call>"}}\n</tool_call>'


@pytest.mark.parametrize(("choice", "text"), [
    ("auto", "Sure. " + DICE_CALL),
    ("auto", "a <tool_ x <tool_cal"),  # tag-like text that never becomes a call
    ("auto", '<tool_call>{"name": "nope", "arguments": {}}</tool_call> then text'),
    ("auto", DICE_CALL + "\n" + OSLO_CALL + " trailing"),
    ("auto", DICE_CALL + "\n" + CITY_CALL),
    ("auto", DICE_CALL + "\n<tool_call>{broken}</tool_call>\n" + CITY_CALL),  # the calls end at a bad block
    ("auto", DICE_CALL + "\n<tool_call>\n{\"name\": \"get_w"),  # cut inside a second block
    ("required", DICE_CALL + "\n" + CITY_CALL),
    ("required", DICE_CALL[:58]),  # cut inside the arguments
    ("required", DICE_CALL[:20]),  # cut before the name is whole
])
def test_a_streamed_reply_splits_as_the_whole_reply_whatever_its_pieces(choice, text) -> None:
    use = parse_tool_use([ROLL, WEATHER], choice, None)
    want = split_calls(text, use)
    for size in (1, 2, 3, 5, len(OPEN), len(text)):
        stream = CallStream(use)
        deltas = [d for i in range(0, len(text), size) for d in stream.feed(text[i:i + size])] + stream.finish()
        content, calls = gather_tool_deltas(deltas)
        assert [c["function"] for c in calls] == [c["function"] for c in want[1]], size
        assert content == ((want[0] or "") if calls or use.forced else text), size  # forced: the grammar's, no text
        assert [c["index"] for d in deltas for c in d.get("tool_calls", []) if "id" in c] == list(range(len(calls)))


def test_split_calls_ends_the_calls_at_a_bad_block_and_keeps_a_cut_constrained_call() -> None:
    auto = parse_tool_use([ROLL, WEATHER], "auto", None)
    content, calls = split_calls("Hi " + DICE_CALL + "\n<tool_call>{broken}</tool_call>\n" + CITY_CALL, auto)
    assert content == "Hi " and [c["function"]["name"] for c in calls] == ["roll_dice"]
    forced = parse_tool_use([ROLL, WEATHER], "required", None)
    _content, [call] = split_calls(CITY_CALL, forced)
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo}\\n</tool_call>"}'}
    assert read_calls(DICE_CALL[:58], forced) == (None, [{"id": ANY, "type": "function", "function": {
        "name": "roll_dice", "arguments": '{"count": 2'}}], True)  # cut inside: the arguments so far, and it says so
    assert read_calls(DICE_CALL, forced)[2] is False


def test_a_constrained_call_streams_its_arguments_as_they_are_written() -> None:
    use = parse_tool_use([ROLL, WEATHER], {"type": "function", "function": {"name": "roll_dice"}}, None)
    stream = CallStream(use)
    assert stream.feed('<tool_call>\n{"name": "roll_dice", "argu') == []
    opened, first = stream.feed('ments": {"cou')  # the name is whole: the call opens, its arguments begin
    assert opened["tool_calls"][0]["function"] == {"name": "roll_dice", "arguments": ""}
    assert opened["tool_calls"][0]["index"] == 0 and opened["tool_calls"][0]["type"] == "function"
    assert first == {"tool_calls": [{"index": 0, "function": {"arguments": '{"cou'}}]}
    assert stream.feed('nt": 2, "sides": 6}') == [{"tool_calls": [{"index": 0, "function": {"arguments": 'nt": 2, "sides": 6'}}]}]
    # A brace that may be the call's own is held until the next text shows whose it is.
    assert stream.feed("}") == [{"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}]
    assert stream.feed("\n</tool_") == [] and stream.in_call
    assert stream.feed("call>") == []
    assert stream.finish() == [] and stream.called and not stream.in_call


def test_an_auto_call_is_sent_when_its_block_closes() -> None:
    stream = CallStream(parse_tool_use([ROLL, WEATHER], "auto", None))
    assert stream.feed("Rolling: <tool") == [{"content": "Rolling: "}]
    assert stream.feed(DICE_CALL[5:-3]) == []  # held: a block is a call only once it is whole
    opened, arguments = stream.feed(DICE_CALL[-3:])
    assert opened["tool_calls"][0]["function"] == {"name": "roll_dice", "arguments": ""}
    assert arguments == {"tool_calls": [{"index": 0, "function": {"arguments": '{"count": 2, "sides": 6}'}}]}


def _events(body: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in body.split(b"\n") if line.startswith(b"data: {")]


def test_reply_streams_parallel_calls_with_indexes_and_the_client_accumulates_them() -> None:
    """The SSE chunks of a reply with content and two calls, read back by the openai library's own accumulator."""
    use = parse_tool_use([ROLL, WEATHER], "auto", None)
    text = "Let me check. " + DICE_CALL + "\n" + OSLO_CALL
    whole = Reply(True, "chatcmpl-1", 0, "m", None, False, tools=use).choice(0, text, None, "stop")
    streamed = Reply(True, "chatcmpl-1", 0, "m", None, False, tools=use)
    body = streamed.role_chunk(1) + b"".join(
        streamed.delta_chunk(0, text[i:i + 4], None, None) for i in range(0, len(text), 4))
    body += streamed.delta_chunk(0, "", None, "stop")
    events = _events(body)
    state = ChatCompletionStreamState()
    for event in events:
        state.handle_chunk(ChatCompletionChunk.model_validate(event))
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == whole["finish_reason"] == "tool_calls"
    assert final.message.content == whole["message"]["content"] == "Let me check. "
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]]
    opened = [t for e in events for t in e["choices"][0]["delta"].get("tool_calls", []) if "id" in t]
    assert [t["index"] for t in opened] == [0, 1]
    assert events[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}


# ------------------------------------------------------------------- the real model
pytestmark_real = pytest.mark.real_model
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
ALICE = [{"role": "user", "content": "Alice is 31 and lives in Paris. Give her as JSON."}]
DICE = [{"role": "user", "content": "Roll two six-sided dice for me."}]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    age: int


@pytest.fixture(scope="module")
def smol(real_gguf):
    app = create_app(ModelSpec(str(real_gguf), "smol", {"max_model_len": 1024, "kv_cache_memory": 64 * 1024 * 1024}))
    with LiveServer(app) as live, openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0) as c:
        yield live, c


@pytestmark_real
def test_response_format_json_schema_and_json_object(smol) -> None:
    live, client = smol
    got = client.chat.completions.create(model="smol", messages=ALICE, max_tokens=48, temperature=0,
                                         response_format=_schema(PERSON, "person"))
    assert got.choices[0].finish_reason == "stop"
    record = json.loads(got.choices[0].message.content)
    jsonschema.validate(record, PERSON)
    want = live.call(live.engine.generate(ALICE, SamplingParams(max_tokens=48,
                                                                structured=StructuredOutput.json_schema(PERSON))))
    assert got.choices[0].message.content == want.text  # the engine's own constrained reply
    chunks = list(client.chat.completions.create(model="smol", messages=ALICE, max_tokens=48, temperature=0,
                                                 response_format=_schema(PERSON, "person"), stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    obj = client.chat.completions.create(model="smol", messages=ALICE, max_tokens=32, temperature=0,
                                         response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:  # cut by max_tokens: says so, and is a JSON object's beginning
        assert obj.choices[0].finish_reason == "length" and obj.choices[0].message.content.startswith("{")


@pytestmark_real
def test_parse_with_a_pydantic_model(smol) -> None:
    _live, client = smol
    got = client.chat.completions.parse(model="smol", messages=ALICE, max_tokens=48, temperature=0,
                                        response_format=Person)
    person = got.choices[0].message.parsed
    assert isinstance(person, Person) and got.choices[0].finish_reason == "stop"
    assert person == Person.model_validate_json(got.choices[0].message.content)


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


@pytestmark_real
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "roll_dice"}}])
def test_a_forced_tool_call_round_trips(smol, choice) -> None:
    live, client = smol
    got = client.chat.completions.create(model="smol", messages=DICE, tools=[WEATHER, ROLL], tool_choice=choice,
                                         parallel_tool_calls=False, max_tokens=64, temperature=0)
    (reply,) = got.choices
    assert reply.finish_reason == "tool_calls" and reply.message.content is None
    (call,) = reply.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    tool = {"roll_dice": ROLL, "get_weather": WEATHER}[call.function.name]
    if isinstance(choice, dict):
        assert call.function.name == "roll_dice"
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])

    # streamed: the same call, opened by name, then its arguments in pieces as they are generated
    chunks = list(client.chat.completions.create(model="smol", messages=DICE, tools=[WEATHER, ROLL],
                                                 tool_choice=choice, parallel_tool_calls=False, max_tokens=64,
                                                 temperature=0, stream=True))
    deltas = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    first, pieces = deltas[0], deltas[1:]
    assert (first.index, first.type, first.function.name, first.function.arguments) == (
        0, "function", call.function.name, "")
    assert first.id.startswith("call_") and len(pieces) > 1  # not one lump at the end
    assert all(p.index == 0 and p.id is None and p.function.name is None for p in pieces)
    assert "".join(p.function.arguments for p in pieces) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(not c.choices[0].delta.content for c in chunks)
    state = ChatCompletionStreamState()  # the openai library's own accumulation of the chunks
    for chunk in chunks:
        state.handle_chunk(chunk)
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and _calls(final.message) == _calls(reply.message)

    # the call and its result in the history, then the final answer
    history = [*DICE, reply.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "[3, 5]"}]
    final = client.chat.completions.create(model="smol", messages=history, max_tokens=24, temperature=0)
    assert final.choices[0].message.tool_calls is None and isinstance(final.choices[0].message.content, str)
    rendered = [*DICE, {"role": "assistant", "content": f"<tool_call>\n{json.dumps(_call_json(call))}\n</tool_call>"},
                {"role": "user", "content": "<tool_response>\n[3, 5]\n</tool_response>"}]
    assert final.usage.prompt_tokens == len(live.engine.apply_chat_template(rendered))


def _call_json(call) -> dict:
    return {"name": call.function.name, "arguments": json.loads(call.function.arguments)}


@pytestmark_real
def test_auto_describes_the_tools_and_parses_what_the_model_writes(smol) -> None:
    live, client = smol
    got = client.chat.completions.create(model="smol", messages=DICE, tools=[ROLL], max_tokens=24, temperature=0)
    use = parse_tool_use([ROLL], None, None)  # "auto", the default with tools
    assert got.usage.prompt_tokens == len(live.engine.apply_chat_template(use.with_prompt(DICE)))
    text = live.call(live.engine.generate(use.with_prompt(DICE), SamplingParams(max_tokens=24))).text
    content, calls = split_calls(text, use)
    (reply,) = got.choices
    assert reply.message.content == content
    assert [(c.function.name, c.function.arguments) for c in reply.message.tool_calls or []] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls]
    chunks = list(client.chat.completions.create(model="smol", messages=DICE, tools=[ROLL], max_tokens=24,
                                                 temperature=0, stream=True))
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(chunk)
    streamed = state.current_completion_snapshot.choices[0]  # (get_final_completion refuses a "length" reply)
    assert (streamed.message.content or None, streamed.finish_reason) == (reply.message.content, reply.finish_reason)
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls or []] == [
        (c.function.name, c.function.arguments) for c in reply.message.tool_calls or []]


@pytestmark_real
def test_parallel_calls_are_each_valid(smol) -> None:
    _live, client = smol
    got = client.chat.completions.create(model="smol", messages=DICE, tools=[ROLL, WEATHER], tool_choice="required",
                                         max_tokens=160, temperature=0)
    (reply,) = got.choices
    assert reply.finish_reason == "tool_calls" and reply.message.tool_calls
    for name, arguments in _calls(reply.message):
        jsonschema.validate(arguments, {"roll_dice": ROLL, "get_weather": WEATHER}[name]["function"]["parameters"])
    assert len({c.id for c in reply.message.tool_calls}) == len(reply.message.tool_calls)
    chunks = list(client.chat.completions.create(model="smol", messages=DICE, tools=[ROLL, WEATHER],
                                                 tool_choice="required", max_tokens=160, temperature=0, stream=True))
    opened = [t.index for c in chunks for t in c.choices[0].delta.tool_calls or [] if t.id is not None]
    assert opened == list(range(len(reply.message.tool_calls)))  # each call opens once, in order: 0, 1, ...
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(chunk)
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and _calls(final.message) == _calls(reply.message)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("route", "field", "body"), [
    ("/v1/chat/completions", "response_format", {**CHAT, "response_format": {"type": "json_object"}}),
    ("/v1/completions", "guided_regex", {**TEXT, "guided_regex": "[a-c]{3}-no-llguidance"}),
])
def test_structured_output_without_llguidance_is_a_501_not_the_client_s_400(server, http, monkeypatch, route, field,
                                                                            body, stream) -> None:
    """Without the grammar library the server cannot do what a valid body asks: a server error, 501
    ``not_implemented`` naming the field and the install, and the server serves on."""
    import asyncinfer.grammar

    monkeypatch.setattr(asyncinfer.grammar, "library_missing",
                        lambda: "structured output needs llguidance (pip install 'asyncinfer[structured]'): gone")
    r = http.post(route, json={**body, "stream": stream})
    assert r.status_code == 501, r.text
    error = r.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("server_error", "not_implemented", field)
    assert "llguidance" in error["message"] and "asyncinfer[structured]" in error["message"]
    monkeypatch.undo()
    assert http.post(route, json=TEXT if route == "/v1/completions" else CHAT).status_code == 200
