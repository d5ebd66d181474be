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
