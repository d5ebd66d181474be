"""Structured output: ``SamplingParams(structured=StructuredOutput...)`` constrains what the engine writes.

The spec's checks and the sampler's masking run without a model (a fake matcher allows fixed tokens);
everything else runs the real default model (SmolLM2-135M-Instruct, its default weight format) and
checks the outputs themselves: JSON that parses and validates with ``jsonschema``, text that matches
the regex, one of the choices, for greedy and sampled decoding.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from asyncinfer import (
    AsyncEngine,
    InvalidParameterError,
    RequestOutput,
    SamplingParams,
    StructuredOutput,
)
from asyncinfer.grammar import GrammarMatcher, apply_token_bitmask, bitmask_words
from asyncinfer.request import Request
from asyncinfer.sampler import Sampler, SamplingState
from tests.helpers import AllowTokens, EngineOnLoop

llguidance = pytest.importorskip("llguidance", reason="structured output needs asyncinfer[structured] (llguidance)")

CPU = torch.device("cpu")

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "status": {"enum": ["pending", "shipped", "delivered"]},
        "items": {"type": "array", "minItems": 1, "maxItems": 3,
                  "items": {"type": "object", "additionalProperties": False, "required": ["sku", "quantity"],
                            "properties": {"sku": {"type": "string", "maxLength": 12},
                                           "quantity": {"type": "integer", "minimum": 1, "maximum": 99}}}},
        "paid": {"type": "boolean"},
    },
    "required": ["id", "status", "items", "paid"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20},
                   "celsius": {"type": "number", "minimum": -50, "maximum": 60, "multipleOf": 0.5},
                   "sky": {"enum": ["sunny", "cloudy", "rain", "snow"]}},
    "required": ["city", "celsius", "sky"],
    "additionalProperties": False,
}
SCHEMAS = {"person": PERSON, "order": ORDER, "weather": WEATHER}
PROMPTS = {
    "person": "Ada Lovelace was 36 years old when she died. Give her as a JSON record.",
    "order": "Order ABC-1234 has shipped: 2 blue pens and 1 notebook, paid by card. Give it as JSON.",
    "weather": "It is 21.5 degrees and sunny in Lisbon. Give the weather as JSON.",
}


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# --------------------------------------------------------------------------- the spec, without a model


def test_constructors_build_equal_hashable_specs() -> None:
    a = StructuredOutput.json_schema(PERSON)
    assert a == StructuredOutput.json_schema(json.dumps(PERSON))
    assert hash(a) == hash(StructuredOutput.json_schema(PERSON))
    assert a.kind == "json_schema" and a.schema == PERSON
    assert list(json.loads(a.value)["properties"]) == ["name", "age"]  # the order the JSON is written in
    assert StructuredOutput.json_object() == StructuredOutput(kind="json_object")
    assert StructuredOutput.regex(r"\d+").value == r"\d+"
    assert StructuredOutput.choice(["yes", "no", "yes"]).value == ("yes", "no")
    assert StructuredOutput.grammar('root ::= "a"').kind == "grammar"
    assert SamplingParams(structured=a).structured is a
    assert SamplingParams(n=2, seed=1, structured=a).for_sample(1).structured is a


@pytest.mark.parametrize("make", [
    lambda: StructuredOutput.json_schema([1, 2]),
    lambda: StructuredOutput.json_schema("{not json"),
    lambda: StructuredOutput.json_schema({"type": "object", "default": float("nan")}),
    lambda: StructuredOutput.json_schema({"type": "object", "default": object()}),
    lambda: StructuredOutput.json_schema({1: "x"}),
    lambda: StructuredOutput.regex(""),
    lambda: StructuredOutput.regex(3),
    lambda: StructuredOutput.choice([]),
    lambda: StructuredOutput.choice("yes"),
    lambda: StructuredOutput.choice(["yes", ""]),
    lambda: StructuredOutput.choice(["x"] * 2000),
    lambda: StructuredOutput.grammar(""),
    lambda: StructuredOutput.grammar("x" * 70000),
    lambda: StructuredOutput(kind="yaml", value="a"),
    lambda: StructuredOutput(kind="json_object", value="{}"),
    lambda: SamplingParams(structured={"type": "json_object"}),
])
def test_a_malformed_spec_names_the_field(make: Callable[[], object]) -> None:
    with pytest.raises(InvalidParameterError) as info:
        make()
    assert info.value.parameter == "structured"


@pytest.mark.parametrize("schema", [
    json.loads('{"items": ' * 70 + "{}" + "}" * 70),  # a dict, 70 levels deep
    '{"items": ' * 70 + "{}" + "}" * 70,  # its JSON text, short enough to read
])
def test_a_schema_nested_too_deep_is_refused_for_its_depth(schema: object) -> None:
    """A dict nested past 64 levels was refused as "allowed: a JSON schema (a dict)": it was one already,
    and the message did not say what to change."""
    with pytest.raises(InvalidParameterError) as info:
        StructuredOutput.json_schema(schema)
    assert info.value.parameter == "structured"
    assert str(info.value).endswith("is invalid: allowed a JSON schema nested at most 64 levels")


@pytest.mark.parametrize("text", ["5", "[1]", "true", '"a string"'])
def test_a_schema_text_that_is_no_json_object_is_named_as_given(text: str) -> None:
    """json_schema('5') read 'structured=5 is invalid': the parsed value, as if an int had been passed."""
    with pytest.raises(InvalidParameterError) as info:
        StructuredOutput.json_schema(text)
    assert info.value.parameter == "structured"
    assert info.value.value == text
    assert str(info.value) == (f"structured={text!r} is invalid: allowed a JSON schema (a dict, or its JSON text: "
                               "a JSON object)")


def test_a_spec_given_up_on_mid_way_names_the_output_position_and_the_token_id() -> None:
    """The refusal said "it stopped at token 46880" for a reply's first token: a token id read as a position."""

    class GaveUp:  # a matcher in the state the library leaves it in when it gives up
        def get_error(self) -> str:
            return "lexer error: too many expressions constructed <state>...</state>"

    error = GrammarMatcher(GaveUp()).refusal(StructuredOutput.regex("a{1000}{1000}"), 46880, 1)
    assert error.parameter == "structured"
    assert "(it stopped at output token 1, token id 46880: lexer error: too many expressions constructed)" in str(error)


def test_the_scheduler_sees_a_structured_request() -> None:
    plain = Request("a", [1, 2], SamplingParams(), arrival_time=0.0)
    shaped = Request("b", [1, 2], SamplingParams(structured=StructuredOutput.regex("a+")), arrival_time=0.0)
    assert not plain.is_structured and shaped.is_structured


# --------------------------------------------------------------------------- the sampler, with a fake grammar


@pytest.mark.parametrize(("rows", "vocab"), [(1, 100), (3, 49152), (2, 33), (4, 64)])
def test_apply_token_bitmask_blocks_exactly_the_zero_bits(rows: int, vocab: int) -> None:
    g = torch.Generator().manual_seed(rows * vocab)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows + 2, bitmask_words(vocab)), dtype=torch.int32, generator=g)
    logits = torch.randn(rows, vocab, generator=g)
    expected = logits.clone()
    bits = (bitmask[:rows].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # bit b of word w: token 32w + b
    expected[bits.view(rows, -1)[:, :vocab] == 0] = float("-inf")
    apply_token_bitmask(logits, bitmask)  # rows beyond the logits' are ignored
    assert torch.equal(logits, expected)


def shaped_state(tokens: list[int], **kw: Any) -> SamplingState:
    matcher: Any = AllowTokens(tokens)
    return SamplingState(params=SamplingParams(**kw), prompt_token_ids=[1], matcher=matcher)


def test_structured_rows_take_the_best_allowed_token_and_ignore_the_steps_greedy_ids() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 100, generator=g)
    before = logits.clone()
    allowed = [3, 40, 63, 64, 99]
    plain = SamplingState(params=SamplingParams(), prompt_token_ids=[1])
    # The fused step's argmax (here deliberately not the argmax): the plain greedy row takes it, as it would alone.
    out = Sampler(100, CPU)(logits[:2], [plain, shaped_state(allowed)], greedy_ids=[7, 7])
    best = max(allowed, key=lambda t: float(logits[1, t]))
    assert out.token_ids == [7, best] and out.mask_seconds > 0
    # Beside sampled rows, structured or not, the unconstrained rows get the tokens they get without structured ones.
    seeded = SamplingParams(temperature=1.0, seed=5)
    states = [plain, shaped_state(allowed), SamplingState(params=seeded, prompt_token_ids=[1]),
              shaped_state(allowed, temperature=1.0, seed=7)]
    out = Sampler(100, CPU)(logits, states, greedy_ids=[7, 7, 7, 7])
    alone = Sampler(100, CPU)(logits[[0, 2]], [SamplingState(params=SamplingParams(), prompt_token_ids=[1]),
                                               SamplingState(params=seeded, prompt_token_ids=[1])], greedy_ids=[7, 7])
    assert [out.token_ids[0], out.token_ids[2]] == alone.token_ids
    assert out.token_ids[1] == best and out.token_ids[3] in allowed
    assert torch.equal(logits, before)


def test_sampled_structured_rows_draw_only_allowed_tokens_with_logprobs_of_the_masked_row() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 64, generator=g)
    allowed = [5, 17, 33]
    sampler = Sampler(64, CPU, seed=0)
    seen = set()
    for _ in range(60):
        out = sampler(logits, [shaped_state(allowed, temperature=2.0, top_k=10, logprobs=3)])
        seen.add(out.token_ids[0])
        lp = out.logprobs[0]
        assert lp is not None and sorted(t for t, _ in lp.top) == allowed
        assert abs(sum(torch.tensor([v for _, v in lp.top]).exp().tolist()) - 1) < 1e-5
    assert seen <= set(allowed) and len(seen) > 1
    assert Sampler(64, CPU)(logits, [SamplingState(params=SamplingParams(), prompt_token_ids=[1])]).mask_seconds == 0


# --------------------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def served(real_gguf) -> Iterator[EngineOnLoop]:
    # A KV cache sized for the work, not the default: 32 replies of about 100 tokens at once (192 blocks of 16).
    block = AsyncEngine.plan_memory(real_gguf, max_model_len=512).block_bytes
    s = EngineOnLoop(AsyncEngine.from_pretrained(real_gguf, max_model_len=512, max_num_seqs=32, seed=0,
                                           kv_cache_memory=192 * block))
    yield s
    s.close()


def check_json(out: Any, schema: dict[str, Any]) -> None:
    assert out.finish_reason == "stop", (out.finish_reason, out.text)
    jsonschema.validate(json.loads(out.text), schema)


pytestmark_real = pytest.mark.real_model


@pytestmark_real
def test_greedy_and_sampled_json_parses_and_validates(served: EngineOnLoop) -> None:
    jobs = []
    for name, schema in SCHEMAS.items():
        spec = StructuredOutput.json_schema(schema)
        jobs.append((chat(PROMPTS[name]), SamplingParams(max_tokens=200, structured=spec)))
        jobs.append((chat(PROMPTS[name]), SamplingParams(max_tokens=200, temperature=1.0, seed=11, structured=spec)))
        jobs.append((chat(PROMPTS[name]), SamplingParams(max_tokens=200, temperature=0.7, top_p=0.9, top_k=50, seed=3,
                                                         structured=spec)))
    jobs.append((chat("Extract the person: Alice is 31 years old and lives in Paris. Answer in JSON."),
                 SamplingParams(max_tokens=200, structured=StructuredOutput.json_object())))
    outs = served.generate_all(jobs)
    for (_, params), out in zip(jobs, outs):
        schema = params.structured.schema if params.structured.kind == "json_schema" else {"type": "object"}
        check_json(out, schema)
    assert list(json.loads(outs[3].text)) == list(ORDER["properties"])  # written in the schema's order


@pytestmark_real
def test_regex_choice_and_grammar_outputs_match(served: EngineOnLoop) -> None:
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    date = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
    moods = ["positive", "negative", "neutral"]
    gbnf = 'root ::= "The answer is " ("yes" | "no") "."'
    lark = 'start: "RGB(" NUM "," NUM "," NUM ")"\nNUM: /[0-9]{1,3}/'
    jobs = [
        (chat("Call me at five five five, one two three, four five six seven."),
         SamplingParams(max_tokens=30, structured=StructuredOutput.regex(phone))),
        (chat("When did the Berlin wall fall? Give the date."),
         SamplingParams(max_tokens=30, temperature=1.0, seed=2, structured=StructuredOutput.regex(date))),
        (chat("Review: 'I loved this film.' Sentiment?"),
         SamplingParams(max_tokens=10, structured=StructuredOutput.choice(moods))),
        (chat("Review: 'Awful food.' Sentiment?"),
         SamplingParams(max_tokens=10, temperature=1.0, seed=9, structured=StructuredOutput.choice(moods))),
        (chat("Is water wet?"), SamplingParams(max_tokens=20, structured=StructuredOutput.grammar(gbnf))),
        (chat("Name a colour."), SamplingParams(max_tokens=30, structured=StructuredOutput.grammar(lark))),
    ]
    outs = served.generate_all(jobs)
    assert all(o.finish_reason == "stop" for o in outs), [(o.finish_reason, o.text) for o in outs]
    assert re.fullmatch(phone, outs[0].text) and re.fullmatch(date, outs[1].text)
    assert outs[2].text in moods and outs[3].text in moods
    assert re.fullmatch(r"The answer is (yes|no)\.", outs[4].text)
    assert re.fullmatch(r"RGB\(\d{1,3},\d{1,3},\d{1,3}\)", outs[5].text)
    # A grammar that ends finishes without the EOS token: no other token could follow.
    assert outs[2].token_ids[-1] not in (served.engine.tokenizer.eos_token_id,)


@pytestmark_real
def test_each_of_n_samples_follows_its_own_grammar(served: EngineOnLoop) -> None:
    spec = StructuredOutput.json_schema(PERSON)
    [out] = served.generate_all([(chat(PROMPTS["person"]),
                                  SamplingParams(n=4, max_tokens=120, temperature=1.2, seed=5, structured=spec))])
    assert len(out.outputs) == 4
    for sample in out.outputs:
        check_json(sample, PERSON)
    assert len({s.text for s in out.outputs}) > 1  # the samples did diverge: each matcher followed its own tokens
    # Sample i equals a lone request with seed + i (its own matcher, from the prompt on).
    [alone] = served.generate_all([(chat(PROMPTS["person"]),
                                    SamplingParams(max_tokens=120, temperature=1.2, seed=7, structured=spec))])
    assert alone.token_ids == out.outputs[2].token_ids


@pytestmark_real
def test_a_reply_cut_by_max_tokens_says_length_and_stop_strings_still_stop(served: EngineOnLoop) -> None:
    spec = StructuredOutput.json_schema(ORDER)
    full, cut, stopped = served.generate_all([
        (chat(PROMPTS["order"]), SamplingParams(max_tokens=200, structured=spec)),
        (chat(PROMPTS["order"]), SamplingParams(max_tokens=6, structured=spec)),
        (chat(PROMPTS["order"]), SamplingParams(max_tokens=200, stop=['"status"'], structured=spec)),
    ])
    check_json(full, ORDER)
    assert cut.finish_reason == "length" and len(cut.token_ids) == 6 and cut.token_ids == full.token_ids[:6]
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.text)
    assert stopped.finish_reason == "stop" and stopped.stop_reason == '"status"'
    assert full.text.startswith(stopped.text) and '"status"' not in stopped.text


@pytestmark_real
def test_an_invalid_spec_is_refused_before_queueing_and_the_engine_serves_on(served: EngineOnLoop) -> None:
    engine = served.engine
    bad = [StructuredOutput.regex("a("), StructuredOutput.json_schema({"type": "nonsense"}),
           StructuredOutput.json_schema({"type": "string", "minLength": 5, "maxLength": 2}),
           StructuredOutput.json_schema({"type": "string", "pattern": "(?=look-ahead)"}),
           StructuredOutput.grammar("root ::= ("), StructuredOutput.grammar("start: undefined_rule")]

    async def refused(spec: StructuredOutput) -> tuple[str, str]:
        before = engine.num_unfinished_requests
        with pytest.raises(InvalidParameterError) as info:
            await engine.generate("Hi", SamplingParams(max_tokens=4, structured=spec))
        with pytest.raises(InvalidParameterError):
            async for _ in engine.stream("Hi", SamplingParams(max_tokens=4, structured=spec)):
                pass
        assert engine.num_unfinished_requests == before
        return info.value.parameter, str(info.value)

    for spec in bad:
        parameter, message = served.call(refused(spec))
        assert parameter == "structured", message
        # the library's reason, without the grammar text it wraps a regex in (start: /a(/), never written by the caller
        assert " | " not in message and not re.search(r"\bat \d+\(\d+\)", message)
        assert spec.kind != "regex" or "start:" not in message
    _, message = served.call(refused(StructuredOutput.regex("a(" + "b" * 5000)))
    assert "unclosed group" in message and len(message) < 1000  # the regex is not quoted back whole
    [ok] = served.generate_all([(chat("Is the sky blue?"),
                                 SamplingParams(max_tokens=8, structured=StructuredOutput.choice(["yes", "no"])))])
    assert ok.finish_reason == "stop" and ok.text in ("yes", "no")


@pytestmark_real
def test_unconstrained_neighbours_get_the_tokens_they_get_alone(served: EngineOnLoop) -> None:
    plain = [(chat("Write a haiku about rain."), SamplingParams(max_tokens=24, ignore_eos=True)),
             (chat("Name three rivers."), SamplingParams(max_tokens=24, temperature=0.9, seed=4, ignore_eos=True)),
             (chat("What is 2 + 2?"), SamplingParams(max_tokens=24, logprobs=2, ignore_eos=True))]
    alone = served.generate_all(plain)
    shaped = [(chat(PROMPTS[name]), SamplingParams(max_tokens=120, structured=StructuredOutput.json_schema(schema)))
              for name, schema in SCHEMAS.items()]
    together = served.generate_all(plain + shaped)
    for a, b in zip(alone, together[:3]):
        assert a.token_ids == b.token_ids
    for (_, params), out in zip(shaped, together[3:]):
        check_json(out, params.structured.schema)


@pytestmark_real
def test_grammars_compile_once_per_spec_and_steps_record_their_mask_time(served: EngineOnLoop) -> None:
    engine = served.engine
    spec = StructuredOutput.json_schema({"type": "object", "properties": {"ok": {"type": "boolean"}},
                                         "required": ["ok"], "additionalProperties": False})
    grammars = engine.core.grammars
    assert grammars is not None
    compiled = grammars.compiled
    before = engine.step_stats()
    outs = served.generate_all([(chat("Is it ok?"), SamplingParams(max_tokens=20, structured=spec))])
    outs += served.generate_all([(chat("Is it ok?"), SamplingParams(max_tokens=20, structured=spec))] * 3)
    assert grammars.compiled == compiled + 1  # the first compiled it; the others found it in the cache
    assert all(json.loads(o.text)["ok"] in (True, False) for o in outs)
    after = engine.step_stats()
    assert after.masked_tokens - before.masked_tokens == sum(len(o.token_ids) for o in outs)
    assert after.mask_seconds > before.mask_seconds
    hist = engine.metrics.snapshot().models["default"].step_mask_duration
    assert hist is not None and hist.count > 0


@pytestmark_real
def test_a_profile_shows_the_mask_work(served: EngineOnLoop, tmp_path) -> None:
    engine = served.engine
    spec = StructuredOutput.choice(["alpha", "beta", "gamma"])

    async def run() -> Any:
        job = asyncio.ensure_future(engine.profile(steps=3, path=tmp_path / "prof"))
        while not job.done():  # structured traffic until the profile has its steps
            await engine.generate(chat("Pick one."), SamplingParams(max_tokens=4, structured=spec))
        return await job

    result = served.call(run())
    names = {event.get("name", "") for event in json.loads(result.trace_path.read_text())["traceEvents"]}
    assert "asyncinfer.structured_mask" in names


@pytestmark_real
def test_compiles_queue_in_a_pool_of_their_own_and_leave_the_shared_one_free(served: EngineOnLoop) -> None:
    """One caller's many uncached specs each held a thread of anyio's shared pool (40) while compiling, so
    everyone's off-loop work (a long prompt's tokenizing, a large body's decoding) waited behind them, and
    as many compiles as were sent ran at once on the machine's cores. Now at most
    MAX_CONCURRENT_COMPILES compile at once, in a limiter of their own; the rest wait their turn."""
    import anyio

    from asyncinfer.intake import MAX_CONCURRENT_COMPILES

    grammars = served.engine.core.grammars
    assert grammars is not None
    compile_ = grammars.compile
    release, lock = threading.Event(), threading.Lock()
    running, most = [0], [0]

    def held(spec: StructuredOutput, namespace: str | None = None) -> Any:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            release.wait(60)
            return compile_(spec, namespace)
        finally:
            with lock:
                running[0] -= 1

    patterns = [f"x{i}[a-z]{{2}}" for i in range(6)]

    async def run() -> tuple[int, int, int, str, list[RequestOutput]]:
        shared = anyio.to_thread.current_default_thread_limiter()
        before = shared.borrowed_tokens
        jobs = [asyncio.ensure_future(served.engine.generate(chat("Code?"), SamplingParams(
            max_tokens=6, structured=StructuredOutput.regex(p)))) for p in patterns]
        for _ in range(500):  # until the compiles' limiter is full
            await asyncio.sleep(0.01)
            if running[0] >= MAX_CONCURRENT_COMPILES:
                break
        await asyncio.sleep(0.3)  # time for any more to start, were they allowed to
        held_now, borrowed = running[0], shared.borrowed_tokens - before
        free = await anyio.to_thread.run_sync(lambda: "free")  # the shared pool serves meanwhile
        release.set()
        return held_now, borrowed, most[0], free, list(await asyncio.gather(*jobs))

    grammars.compile = held  # type: ignore[method-assign]
    try:
        held_now, borrowed, most_at_once, free, outs = served.call(run())
    finally:
        release.set()
        del grammars.compile
    assert held_now == most_at_once == MAX_CONCURRENT_COMPILES
    assert borrowed == 0 and free == "free"
    assert [bool(re.fullmatch(p, out.text)) for p, out in zip(patterns, outs)] == [True] * len(patterns)


def test_grammars_compile_in_a_worker_thread(served: EngineOnLoop) -> None:
    grammars = served.engine.core.grammars
    assert grammars is not None
    threads: list[threading.Thread] = []
    compile_ = grammars.compile

    def spy(spec: StructuredOutput, namespace: str | None = None) -> Any:
        threads.append(threading.current_thread())
        return compile_(spec, namespace)

    grammars.compile = spy  # type: ignore[method-assign]
    try:
        spec = StructuredOutput.regex(r"[a-z]{2,5}-\d")
        [out] = served.generate_all([(chat("Give a code."), SamplingParams(max_tokens=12, structured=spec))])
    finally:
        del grammars.compile
    assert re.fullmatch(r"[a-z]{2,5}-\d", out.text) and out.finish_reason == "stop"
    assert len(threads) == 1 and threads[0] is not served.thread and threads[0] is not threading.main_thread()
    assert threads[0].name != "asyncinfer-core"  # not the engine thread either


@pytestmark_real
def test_greedy_equals_transformers_with_the_same_mask_step_by_step(real_gguf, real_hf_reference) -> None:
    """Float32 weights (token for token transformers' greedy): the engine's constrained greedy output is
    transformers' argmax over the tokens llguidance allows, one token at a time, until the grammar ends."""
    hf, tok = real_hf_reference
    specs = {"person": (StructuredOutput.json_schema(PERSON),
                        llguidance.LLMatcher.grammar_from_json_schema(
                            PERSON, overrides={"whitespace_flexible": False, "item_separator": ", ",
                                               "key_separator": ": "})),
             "regex": (StructuredOutput.regex(r"[A-Z][a-z]+ (is|was) \d{1,3}"),
                       llguidance.LLMatcher.grammar_from_regex(r"[A-Z][a-z]+ (is|was) \d{1,3}"))}
    block = AsyncEngine.plan_memory(real_gguf, dtype="float32", max_model_len=256).block_bytes
    s = EngineOnLoop(AsyncEngine.from_pretrained(real_gguf, dtype="float32", max_model_len=256,
                                           kv_cache_memory=32 * block))  # two replies of up to 256 tokens
    try:
        prompt = s.engine.tokenize(chat(PROMPTS["person"]))
        outs = s.generate_all([(prompt, SamplingParams(max_tokens=60, structured=spec)) for spec, _ in specs.values()])
    finally:
        s.close()
    from llguidance.hf import from_tokenizer
    from llguidance.torch import fill_next_token_bitmask

    vocab = from_tokenizer(tok, n_vocab=hf.config.vocab_size, eos_token=[tok.eos_token_id])
    for (_, grammar), out in zip(specs.values(), outs):
        matcher = llguidance.LLMatcher(vocab, grammar)
        bitmask = torch.zeros((1, (hf.config.vocab_size + 31) // 32), dtype=torch.int32)
        ids: list[int] = []
        with torch.no_grad():
            while len(ids) < 60 and not matcher.is_stopped():
                row = hf(torch.tensor([prompt + ids])).logits[0, -1]
                fill_next_token_bitmask(matcher, bitmask, 0)
                allowed = ((bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()
                allowed = allowed[: row.shape[0]]
                token = int(row.masked_fill(allowed == 0, float("-inf")).argmax())
                assert matcher.consume_token(token)
                ids.append(token)
        assert out.token_ids == ids and out.finish_reason == "stop"


# --------------------------------------------------------------------------- preemption and the prefix cache


@pytestmark_real
def test_the_mask_follows_preemption_and_prefix_cache_hits(real_gguf) -> None:
    spec = StructuredOutput.json_schema(ORDER)
    jobs = [(chat(PROMPTS["order"] + f" (copy {i})"), SamplingParams(max_tokens=150, structured=spec))
            for i in range(4)]

    def run(**options: Any) -> tuple[list[RequestOutput], Any, Any]:
        s = EngineOnLoop(AsyncEngine.from_pretrained(real_gguf, max_model_len=256, **options))
        try:
            outs = s.generate_all(jobs)
            again = s.generate_all(jobs[:1])  # its prompt's blocks are cached now
            return outs + again, s.engine.kv_stats(), s.engine.step_stats()
        finally:
            s.close()

    block = AsyncEngine.plan_memory(real_gguf, max_model_len=256).block_bytes
    roomy, _, _ = run(kv_cache_memory=64 * block)  # all four at once, up to 256 tokens each
    tight, kv, steps = run(kv_cache_memory=17 * block, kv_watermark=0.0)  # one 256-token request and a block
    assert steps.preemptions > 0 and kv.prefix_hits > 0
    for a, b in zip(roomy, tight):
        assert a.token_ids == b.token_ids
        check_json(b, ORDER)


# --------------------------------------------------------------------------- generated schemas


_NAMES = st.from_regex(r"[a-z]{1,8}", fullmatch=True)
_LEAVES = st.one_of(
    st.integers(1, 8).map(lambda n: {"type": "string", "maxLength": n}),
    st.sampled_from(["^[a-z]+$", "^[A-Z][a-z]*$", "^[0-9]{3}-[0-9]{2}$"]).map(
        lambda p: {"type": "string", "pattern": p, "maxLength": 10}),
    st.tuples(st.integers(-100, 100), st.integers(0, 200)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
    st.tuples(st.integers(-50, 50), st.integers(1, 100), st.sampled_from([0.5, 0.25])).map(
        lambda t: {"type": "number", "minimum": t[0], "maximum": t[0] + t[1], "multipleOf": t[2]}),
    st.just({"type": "boolean"}),
    st.lists(st.from_regex(r"[a-z]{1,6}", fullmatch=True), min_size=1, max_size=4, unique=True).map(
        lambda v: {"enum": v}),
)


@st.composite
def _objects(draw: st.DrawFn, children: st.SearchStrategy[dict[str, Any]]) -> dict[str, Any]:
    props = draw(st.dictionaries(_NAMES, children, min_size=1, max_size=3))
    required = [k for k in props if draw(st.booleans())]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def _arrays(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.tuples(children, st.integers(0, 1), st.integers(0, 1)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2] + 1})


# Few leaves and short strings: each reply is decoded by the real model (400 of them), so the schemas
# vary in kind and nesting rather than in size.
SCHEMA = _objects(st.recursive(_LEAVES, lambda c: st.one_of(_arrays(c), _objects(c)), max_leaves=3))


#: Distinct generated schemas the test decodes, each greedy and sampled.
GENERATED_SCHEMAS = 200
#: Schemas a Hypothesis example draws (distinct in it); examples are drawn until GENERATED_SCHEMAS distinct ones.
SCHEMAS_PER_EXAMPLE = 25
#: Room for a reply: the generated schemas are bounded (short strings, few items), so nearly all end by themselves.
GENERATED_MAX_TOKENS = 128
#: At least this share of the replies must end by themselves (the rest say "length" and are checked as cut).
MIN_COMPLETE = 0.95


def _canonical(schema: dict[str, Any]) -> str:
    return json.dumps(schema, sort_keys=True)


def _draw_distinct_schemas(count: int) -> list[dict[str, Any]]:
    """``count`` distinct schemas drawn by Hypothesis (examples of SCHEMAS_PER_EXAMPLE until there are enough)."""
    drawn: dict[str, dict[str, Any]] = {}

    @settings(max_examples=4 * count // SCHEMAS_PER_EXAMPLE, deadline=None, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate])
    @given(schemas=st.lists(SCHEMA, min_size=SCHEMAS_PER_EXAMPLE, max_size=SCHEMAS_PER_EXAMPLE, unique_by=_canonical))
    def draw(schemas: list[dict[str, Any]]) -> None:
        for schema in schemas:
            if len(drawn) < count:
                drawn.setdefault(_canonical(schema), schema)

    draw()
    assert len(drawn) == count, f"Hypothesis drew {len(drawn)} distinct schemas, not {count}"
    return list(drawn.values())


@pytestmark_real
def test_generated_schemas_greedy_and_sampled_outputs_validate(real_gguf) -> None:
    """200 distinct generated schemas (objects, arrays, enums, nested objects, required fields, string
    patterns and lengths, number bounds), each asked greedy and sampled, all 400 requests at once (one engine
    batching up to 64): every reply that ends by itself parses and validates, one cut by max_tokens says
    "length", has max_tokens tokens and does not parse; at least MIN_COMPLETE of them end by themselves.
    The schemas are drawn first and decoded together (one batch's tail, not one a Hypothesis example), so a
    failure names its schema and reply in the assertion rather than through Hypothesis's shrinking."""
    schemas = _draw_distinct_schemas(GENERATED_SCHEMAS)
    jobs = []
    for i, schema in enumerate(schemas):
        spec = StructuredOutput.json_schema(schema)
        prompt = chat(f"Reply in JSON with the fields {', '.join(schema['properties'])}.")
        jobs.append((prompt, SamplingParams(max_tokens=GENERATED_MAX_TOKENS, structured=spec)))
        jobs.append((prompt, SamplingParams(max_tokens=GENERATED_MAX_TOKENS, temperature=1.0, seed=i,
                                            structured=spec)))
    # 64 replies at once of up to ~40 prompt and 128 output tokens: 11 blocks of 16 each (~0.5 GB of float32 KV).
    block = AsyncEngine.plan_memory(real_gguf, max_model_len=256).block_bytes
    served = EngineOnLoop(AsyncEngine.from_pretrained(real_gguf, max_model_len=256, max_num_seqs=64, seed=0,
                                                kv_cache_memory=64 * 11 * block))
    try:
        outs = served.generate_all(jobs)
    finally:
        served.close()
    finish = {"stop": 0, "length": 0}
    for (_, params), out in zip(jobs, outs):
        assert params.structured is not None
        where = f"schema {_canonical(params.structured.schema)}, reply {out.text!r}"
        assert out.finish_reason in finish, where
        finish[out.finish_reason] += 1
        if out.finish_reason == "stop":
            try:
                jsonschema.validate(json.loads(out.text), params.structured.schema)
            except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
                raise AssertionError(f"{where}: {exc}") from exc
        else:  # cut: says so, never claims to be complete
            assert len(out.token_ids) == GENERATED_MAX_TOKENS, where
            with pytest.raises(json.JSONDecodeError):
                json.loads(out.text)
    assert finish["stop"] + finish["length"] == 2 * GENERATED_SCHEMAS
    assert finish["stop"] >= MIN_COMPLETE * 2 * GENERATED_SCHEMAS, finish
