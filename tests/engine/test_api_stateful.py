"""A Hypothesis state machine over the public API: random sequences of calls, invariants after each.

Rules: generate, stream (read partly, then stop), cancel, abort (in flight, unknown and
malformed ids), id reuse from a small pool, swap to a fresh version of the same weights,
add and remove a second generator, and calls with bad arguments. After every sequence:
every call that was not cancelled or aborted returned exactly its own greedy tokens (those
of transformers on the same prompt), aborted ones a prefix of them, no KV block and no
request is left behind, and the engine still serves.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from asyncinfer import AsyncEngine, InvalidParameterError, SamplingParams

BASE = {"kv_cache_memory": 2 * 1024 * 1024, "max_model_len": 128, "dtype": "float32", "device": "cpu",
        "max_num_seqs": 6}
PROMPTS = [[5, 17, 99, 3], [250, 42, 8, 8, 8, 61, 7], [11] * 20, [300, 2, 19]]
IDS = ["a", "b", "c"]


@dataclass
class Call:
    """One generate() or stream() call the machine started, and what it must end with."""

    model: str
    prompt: int
    max_tokens: int
    n: int
    task: asyncio.Task[Any]
    request_id: str | None = None
    partial: bool = False  # a stream the consumer leaves after a few deltas
    aborted: bool = False
    cancelled: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


class EngineMachine(RuleBasedStateMachine):
    paths: ClassVar[dict[str, Any]] = {}
    reference: Any = None  # (model name, prompt index, max_tokens) -> greedy tokens

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.engine = AsyncEngine.from_pretrained(self.paths["main"], name="main", **BASE)
        self.loop.run_until_complete(self.engine.start())
        self.calls: list[Call] = []
        self.has_second = False

    # ------------------------------------------------------------------ helpers
    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def settle(self, seconds: float = 0.005) -> None:
        self.run(asyncio.sleep(seconds))

    def in_flight_ids(self) -> set[str]:
        return {c.request_id for c in self.calls if c.request_id is not None and not c.task.done()}

    def start(self, model: str, prompt: int, max_tokens: int, n: int, request_id: str | None, partial: bool) -> None:
        params = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True)

        async def generate() -> Any:
            return await self.engine.generate(PROMPTS[prompt], params, request_id=request_id, model=model)

        async def read_partly() -> Any:
            deltas = []
            async for delta in self.engine.stream(PROMPTS[prompt], params, request_id=request_id, model=model):
                deltas.append(delta)
                if len(deltas) == 2:
                    break
            return deltas

        task = self.loop.create_task(read_partly() if partial else generate())
        self.calls.append(Call(model, prompt, max_tokens, n, task, request_id, partial))

    # -------------------------------------------------------------------- rules
    @rule(prompt=st.integers(0, len(PROMPTS) - 1), max_tokens=st.integers(1, 12), n=st.integers(1, 2),
          request_id=st.none() | st.sampled_from(IDS), partial=st.booleans(), second=st.booleans())
    def submit(self, prompt: int, max_tokens: int, n: int, request_id: str | None, partial: bool,
               second: bool) -> None:
        model = "second" if second and self.has_second else "main"
        busy = request_id in self.in_flight_ids()
        self.start(model, prompt, max_tokens, n, request_id, partial)
        self.settle(0)
        task = self.calls[-1].task
        if task.done() and task.exception() is not None:
            err = task.exception()
            # A reused id is refused while its previous request is (or was just) in flight.
            assert isinstance(err, InvalidParameterError) and err.parameter == "request_id", err
            self.calls[-1].extra["refused"] = True
            assert request_id is not None
        elif busy:
            pytest.fail(f"id {request_id!r} was in flight, yet a second request took it")

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        live = [c for c in self.calls if not c.task.done()]
        if live:
            call = data.draw(st.sampled_from(live))
            call.task.cancel()
            call.cancelled = True
        self.settle()

    @rule(data=st.data())
    def abort_in_flight(self, data: st.DataObject) -> None:
        live = [c for c in self.calls if not c.task.done() and c.request_id is not None]
        if live:
            call = data.draw(st.sampled_from(live))
            for other in self.calls:  # every live request under that id ends with "abort"
                if other.request_id == call.request_id and not other.task.done():
                    other.aborted = True
            self.engine.abort(call.request_id)  # type: ignore[arg-type]
        self.settle()

    @rule(bad=st.sampled_from([None, 3, "", ["a"], "no-such-id", "a#1"]))
    def abort_unknown_or_malformed(self, bad: Any) -> None:
        if isinstance(bad, str) and bad:
            self.engine.abort(bad)  # unknown (or an internal sample id): ignored
        else:
            with pytest.raises(InvalidParameterError):
                self.engine.abort(bad)

    @rule(case=st.sampled_from(["params", "prompt", "model", "priority"]))
    def bad_arguments(self, case: str) -> None:
        kwargs: dict[str, Any] = {"params": SamplingParams(max_tokens=2)}
        prompt: Any = PROMPTS[0]
        if case == "params":
            kwargs["params"] = {"max_tokens": 2}
        elif case == "prompt":
            prompt = [5, 10**9]
        elif case == "model":
            kwargs["model"] = "nope"
        else:
            kwargs["priority"] = 2**40
        with pytest.raises(InvalidParameterError):
            self.run(self.engine.generate(prompt, **kwargs))

    @rule(mode=st.sampled_from(["overlap", "drain", "bogus"]))
    def swap_same_weights(self, mode: str) -> None:
        if mode == "bogus":
            with pytest.raises(InvalidParameterError):
                self.run(self.engine.swap_model(self.paths["main"], name="main", mode=mode))
            return
        self.run(self.engine.swap_model(self.paths["main"], name="main", mode=mode))

    @precondition(lambda self: not self.has_second)
    @rule()
    def add_second(self) -> None:
        self.run(self.engine.add_model("second", self.paths["second"], **BASE))
        self.has_second = True

    @precondition(lambda self: self.has_second)
    @rule(abort=st.booleans())
    def remove_second(self, abort: bool) -> None:
        for call in self.calls:
            if call.model == "second" and not call.task.done() and abort:
                call.aborted = True
        self.run(self.engine.remove_model("second", abort=abort))
        self.has_second = False

    @rule()
    def wait_a_little(self) -> None:
        self.settle(0.02)

    # --------------------------------------------------------------- invariants
    @invariant()
    def still_running(self) -> None:
        assert self.engine.state.value == "running"

    def teardown(self) -> None:
        try:
            async def wait_all() -> None:
                await asyncio.gather(*(c.task for c in self.calls), return_exceptions=True)

            self.run(wait_all())
            for call in self.calls:
                self.check(call)
            expected = self.reference("main", 0, 3)
            assert self.run(self.engine.generate(PROMPTS[0], SamplingParams(max_tokens=3, ignore_eos=True))
                            ).token_ids == expected
            self.run(asyncio.sleep(0.05))  # the last aborts' confirmations
            assert self.engine.num_unfinished_requests == 0
            for info in self.engine.model_info():
                assert info.requests_in_flight == 0
            assert self.engine.kv_stats("main").used_blocks == 0
        finally:
            self.run(self.engine.aclose(abort=True))
            self.loop.close()

    def check(self, call: Call) -> None:
        if call.extra.get("refused") or call.task.cancelled():
            return
        err = call.task.exception()
        if err is not None:
            # Removing "second" while a request waits to be admitted to it fails that request.
            assert isinstance(err, InvalidParameterError) and call.model == "second", err
            return
        expected = self.reference(call.model, call.prompt, call.max_tokens)
        if call.partial:  # each sample's deltas (they interleave when n > 1) are a prefix of the greedy tokens
            for index in range(call.n):
                tokens = [t for d in call.task.result() if d.index == index for t in d.token_ids]
                assert tokens == expected[: len(tokens)]
            return
        out = call.task.result()
        assert len(out.outputs) == call.n
        for sample in out.outputs:
            if sample.finish_reason == "abort":
                assert call.aborted, "a request nobody aborted ended with 'abort'"
                assert sample.token_ids == expected[: len(sample.token_ids)]
            else:
                assert sample.finish_reason == "length" and sample.token_ids == expected


def test_random_api_sequences_keep_every_invariant(tiny_models, hf_greedy) -> None:
    cache: dict[tuple[str, int, int], list[int]] = {}
    hf = {"main": tiny_models["llama"][1], "second": tiny_models["qwen2"][1]}

    def reference(model: str, prompt: int, max_tokens: int) -> list[int]:
        key = (model, prompt, max_tokens)
        if key not in cache:
            cache[key] = hf_greedy(hf[model], PROMPTS[prompt], max_tokens)
        return cache[key]

    EngineMachine.paths = {"main": tiny_models["llama"][0], "second": tiny_models["qwen2"][0]}
    EngineMachine.reference = staticmethod(reference)
    run_state_machine_as_test(
        EngineMachine,
        settings=settings(max_examples=8, stateful_step_count=12, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow]),
    )
