"""The compiled-grammar cache is shared by every tenant of a model version (one namespace per ``cache_salt``):
it drops the least recently used entry of the namespace holding the most entries. Dropped from the whole cache's
least recently used end, a caller sending 256 distinct short specs (0.4 s of compiles on the default model's
vocabulary) evicted every other tenant's compiled grammars, each compiled again at its next request (a GBNF grammar
of 1,500 rules: 1.5 s, against microseconds from the cache), as often as the caller liked."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from asyncinfer.grammar import GrammarCompiler
from asyncinfer.structured import StructuredOutput

pytest.importorskip("llguidance", reason="structured output needs asyncinfer[structured] (llguidance)")

SIZE = 6
NAMESPACES = (None, "tenant:a", "tenant:b", "tenant:c")


class CacheMachine(RuleBasedStateMachine):
    """Any sequence of compiles and look-ups by several namespaces, against a cache of SIZE entries (each compile
    a stand-in object: the policy is what is tested): an entry leaves only when the cache overflows, and only from
    a namespace that then held the most entries."""

    def __init__(self) -> None:
        super().__init__()
        self.compiler = GrammarCompiler(None, 320, [2], cache_size=SIZE)
        self.compiler._compile = lambda spec: object()  # type: ignore[method-assign]
        self.held: dict[tuple[str | None, StructuredOutput], object] = {}

    @rule(namespace=st.sampled_from(NAMESPACES), spec=st.integers(0, 9))
    def compile(self, namespace: str | None, spec: int) -> None:
        key = (namespace, StructuredOutput.regex(f"s{spec}"))
        before = dict(self.held)
        compiled = self.compiler.compile(key[1], namespace)
        if key in before:
            assert compiled is before[key]  # found, not compiled again
        after = dict(self.compiler._cache)
        assert after[key] is compiled and len(after) <= SIZE
        gone = set(before) - set(after)
        assert set(after) - set(before) <= {key}
        if key in before or len(before) < SIZE:
            assert not gone, (gone, "left a cache with room")
        else:  # the insert overflowed it: one entry left, of a namespace then holding the most
            assert len(gone) == 1
            (evicted,) = gone
            counts = Counter(ns for ns, _ in [*before, key])
            assert counts[evicted[0]] == max(counts.values()), (evicted, counts)
        self.held = after

    @rule(namespace=st.sampled_from(NAMESPACES), spec=st.integers(0, 9))
    def look_up(self, namespace: str | None, spec: int) -> None:
        key = (namespace, StructuredOutput.regex(f"s{spec}"))
        assert self.compiler.cached(key[1], namespace) is self.held.get(key)

    @invariant()
    def counts_agree(self) -> None:
        assert dict(self.compiler._cache) == self.held


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_a_tenant_sending_a_caches_worth_of_specs_evicts_its_own(tiny_chat_model) -> None:
    from transformers import AutoTokenizer

    compiler = GrammarCompiler(AutoTokenizer.from_pretrained(tiny_chat_model), 320, [2])
    rules = "root ::= r0\n" + "".join(f'r{i} ::= "x{i}" r{i + 1} | "y"\n' for i in range(40)) + 'r40 ::= "z"\n'
    victim = [StructuredOutput.grammar(rules), StructuredOutput.json_object(), StructuredOutput.choice(["yes", "no"])]
    kept = [compiler.compile(spec, "tenant:victim") for spec in victim]
    for i in range(2 * compiler.cache_size):
        compiler.compile(StructuredOutput.regex(f"a{i}[0-9]+"), "tenant:flood")
    assert [compiler.cached(spec, "tenant:victim") for spec in victim] == kept  # were all None: evicted
    compiled = compiler.compiled
    assert [compiler.compile(spec, "tenant:victim") for spec in victim] == kept and compiler.compiled == compiled
    # the flood's own: its latest, up to what the cache holds beside the victim's
    assert compiler.cached(StructuredOutput.regex(f"a{2 * compiler.cache_size - 1}[0-9]+"), "tenant:flood")
    assert compiler.cached(StructuredOutput.regex("a0[0-9]+"), "tenant:flood") is None


@pytest.mark.parametrize("who", ["cache_salt", "tenant", "tenant, one salt"])
def test_one_tenants_compiles_hold_one_of_the_engines_places(tiny_chat_model, monkeypatch, who: str) -> None:
    """A tenant (``tenant=``, else ``cache_salt``) compiles one spec at a time: its specs queued ahead of another
    tenant's took every place (``MAX_CONCURRENT_COMPILES``), and six GBNF grammars of 1,500 rules kept a regular
    expression, 6 ms alone, waiting 4.5 s. Here the flood's compiles block until the other tenant's has run. Tenants
    sharing cached prefixes (one salt, or none: a server's default) took the places as they came, until ``tenant``."""
    import asyncio
    import threading

    from asyncinfer import AsyncEngine, SamplingParams
    from asyncinfer.intake import MAX_CONCURRENT_COMPILES
    from tests.helpers import ENGINE_BASE

    flood = [StructuredOutput.regex(f"f{i}[a-z]+") for i in range(MAX_CONCURRENT_COMPILES + 2)]
    release = threading.Event()
    started: list[StructuredOutput] = []
    compile_spec = GrammarCompiler._compile

    def held(self: GrammarCompiler, spec: StructuredOutput):  # type: ignore[no-untyped-def]
        started.append(spec)
        if spec in flood:
            assert release.wait(20), "the other tenant's compile never ran"
        return compile_spec(self, spec)

    monkeypatch.setattr(GrammarCompiler, "_compile", held)

    async def run() -> list[str]:
        engine = await AsyncEngine.load(tiny_chat_model, **ENGINE_BASE)
        async with engine:
            params = [SamplingParams(max_tokens=2, structured=spec) for spec in flood]
            flooding, victim = {
                "cache_salt": ({"cache_salt": "tenant:flood"}, {"cache_salt": "tenant:victim"}),
                "tenant": ({"tenant": "flood"}, {"tenant": "victim"}),
                "tenant, one salt": ({"tenant": "flood", "cache_salt": "all"}, {"tenant": "victim", "cache_salt": "all"}),
            }[who]
            waiting = [asyncio.ensure_future(engine.generate("hi", p, **flooding)) for p in params]
            while not started:
                await asyncio.sleep(0.01)
            mine = await engine.generate("hi", SamplingParams(max_tokens=2, structured=StructuredOutput.regex(
                "[a-z]{2,5}")), **victim)  # hung here: every place held by the flood
            assert len(started) == 2 and started[0] in flood  # the flood's first, then the victim's
            release.set()
            outs = await asyncio.gather(*waiting)
        return [mine.outputs[0].finish_reason, *(out.outputs[0].finish_reason for out in outs)]

    try:
        assert asyncio.run(run()) == ["length"] * (len(flood) + 1)
    finally:
        release.set()


def _queued_compiles(tiny_chat_model, monkeypatch, then: str, salt: str | None = "tenant:a",
                     running: int = 1) -> tuple[list[StructuredOutput], list[object]]:
    """Four specs of one tenant (``salt``), the first ``running`` compiles held while the others wait their turn
    (or a place); ``then`` the others are aborted by id ("abort") or the engine is closed ("close") before the held
    compiles go on. The specs whose compile ran, and what each call ended with."""
    import asyncio
    import threading

    from asyncinfer import AsyncEngine, SamplingParams
    from tests.helpers import ENGINE_BASE

    specs = [StructuredOutput.regex(f"q{i}[a-z]+") for i in range(4)]
    release = threading.Event()
    started: list[StructuredOutput] = []
    compile_spec = GrammarCompiler._compile

    def held(self: GrammarCompiler, spec: StructuredOutput):  # type: ignore[no-untyped-def]
        started.append(spec)
        assert release.wait(20), "never released"
        return compile_spec(self, spec)

    monkeypatch.setattr(GrammarCompiler, "_compile", held)

    async def run() -> list[object]:
        engine = await AsyncEngine.load(tiny_chat_model, **ENGINE_BASE)
        await engine.start()
        try:
            calls = [asyncio.ensure_future(engine.generate("hi", SamplingParams(max_tokens=2, structured=spec),
                                                           request_id=f"q{i}", cache_salt=salt))
                     for i, spec in enumerate(specs)]
            while len(started) < running:
                await asyncio.sleep(0.01)
            if then == "abort":
                for i in range(running, 4):
                    engine.abort(f"q{i}")
            else:
                await engine.aclose(abort=True)
            release.set()
            ends = await asyncio.gather(*calls, return_exceptions=True)
        finally:
            release.set()
            await engine.aclose(abort=True)
        return [type(end).__name__ if isinstance(end, BaseException) else end.outputs[0].finish_reason  # type: ignore[union-attr]
                for end in ends]

    return started, asyncio.run(run())


def test_aborted_requests_waiting_their_compile_turn_are_not_compiled(tiny_chat_model, monkeypatch) -> None:
    """A request aborted while it waits its tenant's compile turn ends as an abort without its spec compiled: each
    was compiled in its turn after the abort (five aborted 1.5 s grammars held the tenant's next request 7.5 s)."""
    started, ends = _queued_compiles(tiny_chat_model, monkeypatch, "abort")
    assert ends == ["length", "abort", "abort", "abort"]
    assert started == [StructuredOutput.regex("q0[a-z]+")]


def test_a_closed_engines_queued_compiles_are_not_run(tiny_chat_model, monkeypatch) -> None:
    """The engine closed while a tenant's requests wait their compile turn: they end with EngineClosedError without
    their specs compiled (each was compiled in turn after the close, its call waiting for it)."""
    started, ends = _queued_compiles(tiny_chat_model, monkeypatch, "close")
    assert ends == ["EngineClosedError"] * 4
    assert started == [StructuredOutput.regex("q0[a-z]+")]


def test_aborted_requests_waiting_for_a_compile_place_are_not_compiled(tiny_chat_model, monkeypatch) -> None:
    """Without a salt, requests wait for one of the engine's places: one aborted meanwhile is not compiled either."""
    from asyncinfer.intake import MAX_CONCURRENT_COMPILES

    started, ends = _queued_compiles(tiny_chat_model, monkeypatch, "abort", None, MAX_CONCURRENT_COMPILES)
    assert ends == ["length"] * MAX_CONCURRENT_COMPILES + ["abort"] * (4 - MAX_CONCURRENT_COMPILES)
    assert sorted(map(repr, started)) == sorted(repr(StructuredOutput.regex(f"q{i}[a-z]+"))
                                                for i in range(MAX_CONCURRENT_COMPILES))


def test_a_cancelled_call_holds_its_compiles_place_until_the_compile_ends(tiny_chat_model, monkeypatch) -> None:
    """A call cancelled while its spec compiles (``asyncio`` cancel, as ``wait_for`` or a client's disconnect does)
    ends once the compile has, holding its tenant's turn and its place till then: it ended at once, its compile ran
    on in its thread without either, so a caller that cancelled each costly spec as it began ran any number of
    compiles at once (five held here, the engine's limit two)."""
    import asyncio
    import threading

    from asyncinfer import AsyncEngine, SamplingParams
    from tests.helpers import ENGINE_BASE

    release = threading.Event()
    running: list[StructuredOutput] = []
    most = [0]
    compile_spec = GrammarCompiler._compile

    def held(self: GrammarCompiler, spec: StructuredOutput):  # type: ignore[no-untyped-def]
        running.append(spec)
        most[0] = max(most[0], len(running))
        try:
            assert release.wait(20), "never released"
            return compile_spec(self, spec)
        finally:
            running.remove(spec)

    monkeypatch.setattr(GrammarCompiler, "_compile", held)

    def call(engine: AsyncEngine, i: int) -> asyncio.Future:
        return asyncio.ensure_future(engine.generate(
            "hi", SamplingParams(max_tokens=2, structured=StructuredOutput.regex(f"c{i}[a-z]+")), tenant="flood"))

    async def run() -> list[object]:
        engine = await AsyncEngine.load(tiny_chat_model, **ENGINE_BASE)
        async with engine:
            first = call(engine, 0)
            while not running:
                await asyncio.sleep(0.01)
            first.cancel()
            done, _ = await asyncio.wait({first}, timeout=0.5)
            ended_early = bool(done)
            places = engine._intake.compiles.borrowed_tokens
            rest = [call(engine, i) for i in range(1, 5)]
            for _ in range(20):
                await asyncio.sleep(0.01)
            waiting = len(running)
            for late in rest[:3]:
                late.cancel()  # waiting their tenant's turn: they end at once, never compiled
            done, _ = await asyncio.wait(set(rest[:3]), timeout=5)
            assert len(done) == 3 and len(running) == 1
            release.set()
            ends = await asyncio.gather(first, *rest, return_exceptions=True)
            assert engine._intake.compiles.borrowed_tokens == 0 and not engine._intake._compile_turns
        return [ended_early, places, waiting, most[0],
                *(type(end).__name__ if isinstance(end, BaseException) else end.outputs[0].finish_reason  # type: ignore[union-attr]
                  for end in ends)]

    try:
        assert asyncio.run(run()) == [False, 1, 1, 1, "CancelledError", "CancelledError", "CancelledError",
                                      "CancelledError", "length"]
    finally:
        release.set()
