"""Adversarial pass 15 (issue 25): structured-output specs whose regular expressions llguidance
intersects.

llguidance builds one regular expression for the patterns a value must match at once (a JSON schema's ``allOf``
items, ``$ref`` targets with their own ``pattern``, the ``properties``, ``items`` and ``additionalProperties``
those merge; a Lark grammar's ``&``), and its construction grows exponentially with their number before any of
the library's own limits apply: 20 patterns took 1.4 s, 25 asked for gigabytes and the process aborted
(``memory allocation of 8216641536 bytes failed``, SIGABRT): one caller's ``response_format`` of about a kilobyte
took the server and every other caller down. More than ``MAX_SCHEMA_PATTERNS`` = 8 such patterns on one value (or
``MAX_GRAMMAR_INTERSECTIONS`` = 8 ``&`` in a grammar) are refused by ``structured`` before the library reads them.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from asyncinfer.grammar import _intersections, _schema_patterns
from tests.helpers import compile_in_child


def _patterns(n: int, start: int = 0) -> list[dict]:
    return [{"type": "string", "pattern": f"a{i}"} for i in range(start, start + n)]


_CHAIN = {f"p{i}": {"$ref": f"#/$defs/p{i + 1}", "pattern": f"a{i}"} for i in range(29)}
_CHAIN["p29"] = {"type": "string", "pattern": "a29"}
_CRASHING = {
    "all_of": {"allOf": _patterns(50)},
    "refs": {"$defs": {f"p{i}": p for i, p in enumerate(_patterns(30))},
             "allOf": [{"$ref": f"#/$defs/p{i}"} for i in range(30)]},
    "ref_chain": {"$defs": _CHAIN, "$ref": "#/$defs/p0"},
    "anchors": {"$defs": {f"p{i}": {**p, "$anchor": f"p{i}"} for i, p in enumerate(_patterns(30))},
                "allOf": [{"$ref": f"#p{i}"} for i in range(30)]},
    "encoded_pointer": {"$defs": {f"p{i}": p for i, p in enumerate(_patterns(30))},
                        "allOf": [{"$ref": f"#/%24defs/p{i}"} for i in range(30)]},
    "property": {"type": "object", "properties": {"k": {"type": "string", "pattern": "a"}},
                 "allOf": [{"properties": {"k": p}} for p in _patterns(30)]},
    "items": {"type": "array", "allOf": [{"items": p} for p in _patterns(30)]},
    "additional": {"type": "object", "allOf": [{"additionalProperties": p} for p in _patterns(30)]},
}
_SPECS = {**{name: f"StructuredOutput.json_schema({json.dumps(s)!r})" for name, s in _CRASHING.items()},
          "lark_and": "StructuredOutput.grammar('start: A\\nA: ' + ' & '.join('/.*a%d.*/' % i for i in range(30)))",
          "lark_json": "StructuredOutput.grammar('start: x\\nx: %json ' + "
                       f"{json.dumps(_CRASHING['all_of'])!r})"}


@pytest.mark.parametrize("name", list(_SPECS))
def test_a_spec_intersecting_many_patterns_is_refused_before_the_grammar_library_reads_it(tiny_chat_model,
                                                                                           name) -> None:
    """Each spec is compiled in a child interpreter (under a 3 GiB address-space limit), as the engine compiles it:
    before, each ended it with SIGABRT (``memory allocation ... failed``); now each is an InvalidParameterError on
    ``structured`` naming the limit, at once."""
    done = compile_in_child(tiny_chat_model, _SPECS[name], address_space=3 * 1024 ** 3)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.startswith("refused structured "), done.stdout
    if name == "lark_and":
        assert "at most 8 intersections (&) of regular expressions, got 29" in done.stdout
    else:
        assert "to match at most 8 regular expressions (pattern, format) at once" in done.stdout, done.stdout


def test_schemas_of_many_patterns_on_different_values_are_counted_per_value() -> None:
    """Patterns on different properties, alternatives of an ``anyOf``, a recursive ``$ref`` and an ``allOf`` that
    only wraps a ``$ref`` (pydantic's field description) are no intersection; patterns merged into one value are
    counted each once, with its ``format``; of an ``anyOf`` merged into it, its costliest alternative."""
    fields = {f"f{i}": {"type": "string", "pattern": f"[0-9]{{{i + 1}}}"} for i in range(30)}
    assert _schema_patterns({"type": "object", "properties": fields}) == 1
    assert _schema_patterns({"$defs": {"A": {"type": "object", "properties": fields}}, "type": "object",
                             "properties": {"a": {"allOf": [{"$ref": "#/$defs/A"}], "description": "x"}}}) == 1
    assert _schema_patterns({"anyOf": _patterns(20)}) == 1
    assert _schema_patterns({"$defs": {"n": {"type": "object", "properties": {
        "v": {"type": "string", "pattern": "[a-z]+"}, "next": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}}}},
        "$ref": "#/$defs/n"}) == 1
    assert _schema_patterns({"allOf": [*_patterns(8), *_patterns(8), {"format": "email"}]}) == 9
    assert _schema_patterns({"allOf": _patterns(3), "anyOf": [{"allOf": _patterns(4, 3)}, {"pattern": "b"}]}) == 7
    assert _schema_patterns({"$defs": _CHAIN, "$ref": "#/$defs/p0"}) == 30
    # a $ref that is no local JSON pointer (an $anchor, an $id) may name any part: it counts every pattern
    assert _schema_patterns({"type": "object", "properties": fields, "$defs": {"s": {"$anchor": "s"}},
                             "additionalProperties": {"$ref": "#s"}}) == 30


def test_ampersands_in_literals_and_comments_are_no_intersection() -> None:
    assert _intersections('start: A | "&&\\"&&" | /&&\\/&&/\nA: "a" // &&&&\nB: /x/ & /y/ &/z/') == 2


@pytest.mark.parametrize("spec", [
    ('StructuredOutput.json_schema({"allOf": [{"type": "string", "pattern": "^[a-z0-9]*" + str(i) + "[a-z0-9]*$"} '
     'for i in range(5)]})'),
    'StructuredOutput.grammar("start: A\\nA: " + " & ".join("/.*a%d.*/" % i for i in range(8)))',
])
def test_specs_within_the_limits_still_compile(tiny_chat_model, spec) -> None:
    done = compile_in_child(tiny_chat_model, spec, address_space=3 * 1024 ** 3)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.strip() == "compiled", done.stdout


_SERVER_CHILD = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 * 1024 ** 3, 3 * 1024 ** 3))
import httpx
from asyncinfer.server import ModelSpec, create_app
from tests.server.conftest import TINY_OPTIONS, LiveServer
chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
schema = {"type": "object", "properties": {"k": {"allOf": [{"type": "string", "pattern": "a%d" % i}
                                                           for i in range(40)]}}, "required": ["k"]}
with LiveServer(create_app(ModelSpec(sys.argv[1], "tiny", TINY_OPTIONS))) as live, \\
        httpx.Client(base_url=live.url, timeout=60) as http:
    r = http.post("/v1/chat/completions", json={
        **chat, "response_format": {"type": "json_schema", "json_schema": {"name": "k", "schema": schema}}})
    print(r.status_code, r.json()["error"]["param"], bool(r.headers.get("x-request-id")))
    print(r.json()["error"]["message"])
    print(http.post("/v1/chat/completions", json=chat).status_code)
"""


def test_over_http_a_schema_intersecting_many_patterns_is_a_400_and_the_server_serves_on(tiny_chat_model) -> None:
    """The server runs in a child interpreter (3 GiB address space): before, the request aborted it."""
    done = subprocess.run([sys.executable, "-c", _SERVER_CHILD, str(tiny_chat_model)], check=False,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    status, message, after = done.stdout.strip().splitlines()
    assert status == "400 response_format.json_schema.schema True"
    assert "at most 8 regular expressions (pattern, format) at once (merged by allOf and $ref), got 40" in message
    assert after == "200"


def test_the_merge_count_is_refused_past_its_work_bound_not_walked_for_seconds() -> None:
    """A chain of definitions each merged into the next and into its own property makes the count visit each
    definition once per value it reaches (quadratic): 700 of them, 60 kB of schema, took seconds of Python
    under the GIL before the walk had a bound; past ``MAX_SCHEMA_MERGE_WORK`` it is refused as too costly."""
    import time

    from asyncinfer.grammar import MAX_SCHEMA_MERGE_WORK

    chain = {"$defs": {f"d{i}": {"allOf": [{"$ref": f"#/$defs/d{i + 1}"}],
                                 "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(700)},
             "$ref": "#/$defs/d0"}
    assert len(json.dumps(chain, separators=(",", ":"))) < 65536
    started = time.perf_counter()
    assert _schema_patterns(chain) == MAX_SCHEMA_MERGE_WORK + 1
    assert time.perf_counter() - started < 2.0


_X_GUIDANCE = """
import json, sys
from transformers import AutoTokenizer
from asyncinfer import InvalidParameterError
from asyncinfer.grammar import GrammarCompiler
from asyncinfer.structured import StructuredOutput
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
compiler = GrammarCompiler(tokenizer, 320, [2])
reply = tokenizer.encode('{X"a": 1}', add_special_tokens=False)
for options in ({"whitespace_pattern": "X+"}, {"lenient": True}):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "x-guidance": options}
    try:
        matcher = compiler.compile(StructuredOutput.json_schema(schema)).matcher()
        print("compiled", all(matcher.accept(t) for t in reply))
    except InvalidParameterError as exc:
        print("refused", exc.parameter, exc)
nested = {"type": "object", "properties": {"x-guidance": {"type": "object", "x-guidance": {"lenient": True}}}}
compiler.compile(StructuredOutput.json_schema(nested))
print("nested compiled")
"""


def test_a_schema_with_the_librarys_own_options_is_refused(tiny_chat_model) -> None:
    """A caller's ``"x-guidance": {"whitespace_pattern": "X+"}`` at a schema's top level let the reply
    ``{X"a": 1}`` through, which is no JSON (and ``lenient`` made the library ignore keywords it cannot enforce,
    which the engine refuses); only the top level is the library's: a property or a sub-schema of that name is
    a schema's own."""
    done = subprocess.run([sys.executable, "-c", _X_GUIDANCE, str(tiny_chat_model)], check=False,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 3 and lines[2] == "nested compiled", lines
    for line in lines[:2]:
        assert line.startswith("refused structured ") and "a top-level 'x-guidance' key" in line, line


def _panicking_tokenizer_model(tiny_chat_model, tmp_path):
    """The tiny chat model with a byte-fallback decoder and a vocabulary entry ``<0xZZ>`` (no hex byte): the
    grammar library's reader of the tokenizer panics on it (``ParseIntError``, pyo3's PanicException)."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_chat_model, model)
    data = json.loads((model / "tokenizer.json").read_text())
    data["decoder"] = {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}]}
    vocab = data["model"]["vocab"]
    merged = {part for merge in data["model"]["merges"]
              for a, b in [merge if isinstance(merge, list) else merge.split(" ")] for part in (a, b, a + b)}
    free = [token for token in vocab if token not in merged and not token.startswith("<")]
    vocab["<0xZZ>"] = vocab.pop(free[-1])
    (model / "tokenizer.json").write_text(json.dumps(data))
    return model


def test_a_tokenizer_the_grammar_library_panics_on_is_a_400_naming_the_field(tiny_chat_model, tmp_path) -> None:
    """Before, each structured request raised the library's PanicException (a BaseException: past every
    ``except Exception``), answered by the ASGI server as a plain-text 500 without X-Request-Id, the
    vocabulary read (and the panic) again at each request. Now it is the field's 400, read once; the model
    serves plain requests."""
    import httpx

    from asyncinfer.server import ModelSpec, create_app
    from tests.server.conftest import TINY_OPTIONS, LiveServer

    model = _panicking_tokenizer_model(tiny_chat_model, tmp_path)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with LiveServer(create_app(ModelSpec(str(model), "tiny", TINY_OPTIONS))) as live, \
            httpx.Client(base_url=live.url, timeout=60) as http:
        for _ in range(2):
            r = http.post("/v1/chat/completions", json={**chat, "response_format": {"type": "json_object"}})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "response_format" and "the grammar library panicked reading it" in error["message"]
            assert r.headers["x-request-id"]
        assert http.post("/v1/chat/completions", json=chat).status_code == 200


def test_a_native_panic_in_any_call_is_answered_in_openais_shape(tiny_chat_model, tmp_path, monkeypatch) -> None:
    """A panic of native code while a call is handled (here raised by the body's check) is a 500 in OpenAI's
    error shape with the call's X-Request-Id, and the server serves on; before it went to the ASGI server."""
    import httpx
    import llguidance

    from asyncinfer.server import ModelSpec, create_app
    from asyncinfer.server import router as router_module
    from tests.server.conftest import TINY_OPTIONS, LiveServer

    bad = json.loads((_panicking_tokenizer_model(tiny_chat_model, tmp_path) / "tokenizer.json").read_text())
    try:
        llguidance.LLTokenizer(json.dumps(bad), n_vocab=320)
    except BaseException as exc:  # noqa: BLE001 - the library's PanicException, whose class is nowhere to import
        panic = exc
    assert type(panic).__name__ == "PanicException" and not isinstance(panic, Exception)
    parse = router_module.parse_chat
    panicking = [True]

    def panics(body):
        if panicking.pop() if panicking else False:
            raise type(panic)("native code panicked")
        return parse(body)

    monkeypatch.setattr(router_module, "parse_chat", panics)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with LiveServer(create_app(ModelSpec(str(tiny_chat_model), "tiny", TINY_OPTIONS))) as live, \
            httpx.Client(base_url=live.url, timeout=60) as http:
        r = http.post("/v1/chat/completions", json=chat)
        assert r.status_code == 500, r.text
        assert r.json()["error"]["type"] == "server_error" and r.headers["x-request-id"].startswith("chatcmpl-")
        assert http.post("/v1/chat/completions", json=chat).status_code == 200


_LOAD_CHILD = """
import asyncio, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 * 1024 ** 3, 3 * 1024 ** 3))
from asyncinfer import AsyncEngine, ModelLoadError
from tests.server.conftest import TINY_OPTIONS
async def main():
    try:
        await AsyncEngine.load(sys.argv[1], **TINY_OPTIONS)
        print("loaded")
    except ModelLoadError as exc:
        print("refused", exc)
asyncio.run(main())
"""


@pytest.mark.parametrize("charsmap", ["/////w==", "", "AAA="])
def test_a_tokenizer_charsmap_that_declares_more_than_it_holds_is_a_model_load_error(tiny_chat_model, tmp_path,
                                                                                     charsmap) -> None:
    """A ``Precompiled`` normalizer whose charsmap declares a trie of 0xFFFFFFFF bytes made the tokenizers library
    ask for 8 GiB while the tokenizer was loaded (SIGABRT, in a child under a 3 GiB limit here: a server swapping
    to such a directory died); an empty or short one panicked (PanicException, past ``except Exception``). Each is
    a ModelLoadError naming the file now, before the library reads it."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_chat_model, model)
    data = json.loads((model / "tokenizer.json").read_text())
    data["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Precompiled", "precompiled_charsmap": charsmap}]}
    (model / "tokenizer.json").write_text(json.dumps(data))
    done = subprocess.run([sys.executable, "-c", _LOAD_CHILD, str(model)], check=False, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.startswith("refused "), done.stdout
    assert "tokenizer.json's Precompiled normalizer has a precompiled_charsmap of" in done.stdout


async def test_a_prompt_its_tokenizer_panics_on_is_an_invalid_parameter_and_the_engine_serves_on(tiny_chat_model,
                                                                                                  tmp_path) -> None:
    """A charsmap that declares what it holds but points past its end loads, and the tokenizers library panics on
    every text it normalizes: ``generate`` raised that PanicException (a BaseException, past the caller's
    ``except Exception``); it is the prompt's InvalidParameterError now, and token-id prompts are served."""
    import shutil

    from asyncinfer import AsyncEngine, InvalidParameterError, SamplingParams
    from tests.server.conftest import TINY_OPTIONS

    model = tmp_path / "model"
    shutil.copytree(tiny_chat_model, model)
    data = json.loads((model / "tokenizer.json").read_text())
    data["normalizer"] = {"type": "Precompiled", "precompiled_charsmap": "AAAAAAAAAAAAAAAA"}
    (model / "tokenizer.json").write_text(json.dumps(data))
    engine = await AsyncEngine.load(str(model), **TINY_OPTIONS)
    async with engine:
        for prompt in ("hello", [{"role": "user", "content": "hi"}]):
            with pytest.raises(InvalidParameterError, match="its tokenizer panicked on") as caught:
                await engine.generate(prompt, SamplingParams(max_tokens=2))
            assert caught.value.parameter == "prompt"
        out = await engine.generate([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
        assert len(out.outputs[0].token_ids) == 2
