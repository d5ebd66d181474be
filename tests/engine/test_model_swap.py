"""Model swaps on tiny random models: under load, per-version prefix caches, failures, drain mode."""

from __future__ import annotations

import asyncio
import gc
import shutil
import threading
import time
import weakref

import pytest

from asyncinfer import AsyncEngine, ConfigurationError, InvalidParameterError, ModelChangedError, SwapError, loading
from tests.helpers import ENGINE_BASE, greedy, random_prompts

NUM_PROMPTS = 12
MAX_TOKENS = 24
PROMPTS = random_prompts(NUM_PROMPTS, seed=21)


@pytest.fixture(scope="module")
def expected(tiny_models) -> dict[str, list[list[int]]]:
    """Each prompt's greedy tokens on each model, each from an engine serving that model alone."""

    async def run(kind: str) -> list[list[int]]:
        async with AsyncEngine.from_pretrained(tiny_models[kind][0], **ENGINE_BASE) as engine:
            outs = await asyncio.gather(*(engine.generate(p, greedy(MAX_TOKENS)) for p in PROMPTS))
        return [o.token_ids for o in outs]

    result = {kind: asyncio.run(run(kind)) for kind in ("llama", "qwen2")}
    # The two models must disagree on every prompt, or a mix-up would go unseen.
    assert all(a != b for a, b in zip(result["llama"], result["qwen2"]))
    return result


async def wait_for_one_version(engine: AsyncEngine) -> None:
    for _ in range(500):
        if len(engine.model_info()) == 1:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"old versions still live: {engine.model_info()}")


async def test_swaps_under_load_serve_every_request_on_its_own_version(tiny_models, expected) -> None:
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE)
    kind = "llama"
    swapping_to: str | None = None
    results: list[tuple[int, set[str], list[int], str]] = []
    pinned: list[str] = []  # the version of each finished request submitted outside a swap
    old_refs: list[weakref.ref] = []
    overlapped = 0

    async def client(i: int) -> None:
        j = i
        while not done:  # a steady stream of requests, across every swap
            j = (j + 1) % NUM_PROMPTS
            # Until swap_model returns, a request may be bound to either version.
            allowed = {kind} if swapping_to is None else {kind, swapping_to}
            out = await engine.generate(PROMPTS[j], greedy(MAX_TOKENS))
            results.append((j, allowed, out.token_ids, out.finish_reason))
            if len(allowed) == 1:
                pinned.extend(allowed)
            await asyncio.sleep(0.002 * (i % 3))

    async def served_on(version: str, n: int = 6) -> None:
        """Wait until ``n`` more requests submitted after the last swap have finished."""
        start = len(pinned)
        while len(pinned) - start < n or pinned[-1] != version:
            await asyncio.sleep(0.005)

    done = False
    async with engine:
        clients = [asyncio.create_task(client(i)) for i in range(6)]
        for target in ("qwen2", "llama", "qwen2", "llama"):
            await served_on(kind)
            old_refs.append(weakref.ref(engine.core))
            old_refs.append(weakref.ref(engine.core.runner.model))
            old_refs.append(weakref.ref(engine.core.runner.kv_caches[0][0]))
            swapping_to = target
            info = await engine.swap_model(tiny_models[target][0])
            kind, swapping_to = target, None
            assert info.state == "current" and engine.model_info()[-1].version_id == info.version_id
            live = engine.model_info()
            if len(live) > 1 and live[0].requests_in_flight > 0:
                overlapped += 1
                assert live[0].state == "draining"
        await served_on(kind)
        done = True
        await asyncio.gather(*clients)
        await wait_for_one_version(engine)
        (last,) = engine.model_info()
        assert last.version_id == 4 and last.state == "current" and last.requests_in_flight == 0
    assert overlapped >= 1, "no swap overlapped requests in flight"
    assert len(pinned) >= 5 * 6
    assert {k for _, allowed, _, _ in results for k in allowed} == {"llama", "qwen2"}
    for j, allowed, tokens, finish in results:
        assert finish == "length"
        assert any(tokens == expected[k][j] for k in allowed), (j, allowed)
    gc.collect()
    assert all(ref() is None for ref in old_refs), "an old version's core, weights or KV tensors are still alive"


async def test_prefix_cache_is_per_version(tiny_models) -> None:
    path = tiny_models["llama"][0]
    prompt = list(range(3, 43))  # 40 tokens: two full blocks of 16 can be cached
    engine = AsyncEngine.from_pretrained(path, **ENGINE_BASE)
    async with engine:
        first = await engine.generate(prompt, greedy(4))
        await engine.generate(prompt, greedy(4))
        old_core = engine.core
        assert old_core.stats.prefill_tokens == 40 + (40 - 32)  # the second run hit two blocks
        await engine.swap_model(path)  # the same weights: a shared cache would be valid, and must not be used
        again = await engine.generate(prompt, greedy(4))
        assert engine.core is not old_core
        assert engine.step_stats().prefill_tokens == 40  # computed again on the new version
        assert engine.kv_stats().prefix_hits == 0
    assert again.token_ids == first.token_ids


async def test_a_prompt_pinned_to_a_swapped_out_version_is_refused_and_nothing_is_queued(tiny_models) -> None:
    """``version_id=``: token ids made by one version's tokenizer (or template) are run by that version or refused
    with ModelChangedError, at the call (generate and stream), never handed to the version that replaced it."""
    path = tiny_models["llama"][0]
    async with AsyncEngine.from_pretrained(path, **ENGINE_BASE) as engine:
        old = engine.model_info()[0].version_id
        pinned = await engine.generate([3, 4, 5], greedy(2), version_id=old)
        assert len(pinned.token_ids) == 2
        for bad in (-1, True, "1", 1.0):
            with pytest.raises(InvalidParameterError) as info:
                await engine.generate([3, 4, 5], greedy(2), version_id=bad)
            assert info.value.parameter == "version_id"
        await engine.swap_model(path)
        new = next(i.version_id for i in engine.model_info() if i.state == "current")
        assert new != old
        with pytest.raises(ModelChangedError) as changed:
            await engine.generate([3, 4, 5], greedy(2), version_id=old)
        assert (changed.value.version_id, changed.value.serving) == (old, new)
        with pytest.raises(ModelChangedError):
            engine.stream([3, 4, 5], greedy(2), version_id=old)
        assert engine.num_unfinished_requests == 0
        again = await engine.generate([3, 4, 5], greedy(2), version_id=new)
        assert again.token_ids == pinned.token_ids


async def test_failed_loads_leave_the_old_version_serving(tiny_models, expected, tmp_path, monkeypatch) -> None:
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE)
    bad = tmp_path / "bad-weights"
    shutil.copytree(tiny_models["qwen2"][0], bad)
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    async with engine:
        (before,) = engine.model_info()
        with pytest.raises(SwapError, match="does not exist"):
            await engine.swap_model(tmp_path / "missing")
        with pytest.raises(SwapError):
            await engine.swap_model(bad)

        def broken_warm_up(core, stall_timeout=None) -> None:
            raise RuntimeError("warm-up exploded")

        monkeypatch.setattr(loading, "warm_up", broken_warm_up)
        with pytest.raises(SwapError, match="warm-up exploded") as err:
            await engine.swap_model(tiny_models["qwen2"][0])
        assert isinstance(err.value.__cause__, RuntimeError)
        with pytest.raises(InvalidParameterError, match="mode"):
            await engine.swap_model(tiny_models["qwen2"][0], mode="sideways")
        with pytest.raises(InvalidParameterError, match="no_such_option"):
            await engine.swap_model(tiny_models["qwen2"][0], no_such_option=1)
        assert engine.model_info() == [before]
        out = await engine.generate(PROMPTS[0], greedy(MAX_TOKENS))
    assert out.token_ids == expected["llama"][0]


async def test_a_swap_waits_for_the_swap_in_progress(tiny_models, expected, monkeypatch) -> None:
    real_warm_up = loading.warm_up
    active = 0
    most = 0
    lock = threading.Lock()

    def slow_warm_up(core, stall_timeout=None) -> None:
        nonlocal active, most
        with lock:
            active += 1
            most = max(most, active)
        time.sleep(0.2)
        real_warm_up(core, stall_timeout)
        with lock:
            active -= 1

    monkeypatch.setattr(loading, "warm_up", slow_warm_up)
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE)
    async with engine:
        a = asyncio.create_task(engine.swap_model(tiny_models["qwen2"][0]))
        b = asyncio.create_task(engine.swap_model(tiny_models["llama"][0]))
        serving = await engine.generate(PROMPTS[1], greedy(MAX_TOKENS))  # served while both load
        first, second = await asyncio.gather(a, b)
        await wait_for_one_version(engine)
        out = await engine.generate(PROMPTS[2], greedy(MAX_TOKENS))
    assert most == 1, "two swaps loaded at once"
    assert (first.version_id, second.version_id) == (1, 2)
    assert serving.token_ids == expected["llama"][1]
    assert out.token_ids == expected["llama"][2]


async def test_drain_mode_when_the_new_version_does_not_fit(tiny_models, expected) -> None:
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE)
    tight = 100 * 1024 * 1024  # less than the 256 MiB activation reserve alone
    async with engine:
        with pytest.raises(ConfigurationError, match=r"activation reserve 256\.0 MiB .* 100\.0 MiB are available"):
            await engine.swap_model(tiny_models["qwen2"][0], available_bytes=tight)
        assert len(engine.model_info()) == 1

        # Drain: the old version finishes its requests; requests arriving meanwhile wait for the new one.
        old = [asyncio.create_task(engine.generate(p, greedy(MAX_TOKENS))) for p in PROMPTS[:4]]
        await asyncio.sleep(0.05)
        swap = asyncio.create_task(engine.swap_model(tiny_models["qwen2"][0], mode="drain", available_bytes=tight))
        for _ in range(5000):  # admission is paused once the old version drains
            if [v.state for v in engine.model_info()] != ["current"]:
                break
            await asyncio.sleep(0.001)
        new = [asyncio.create_task(engine.generate(p, greedy(MAX_TOKENS))) for p in PROMPTS[4:8]]
        info = await swap
        assert [o.token_ids for o in await asyncio.gather(*old)] == expected["llama"][:4]
        assert [o.token_ids for o in await asyncio.gather(*new)] == expected["qwen2"][4:8]
        assert [v.version_id for v in engine.model_info()] == [info.version_id]

        # Drain with abort: the old version's requests end at once with "abort".
        old_core = weakref.ref(engine.core)
        old = [asyncio.create_task(engine.generate(p, greedy(200))) for p in PROMPTS[:3]]
        await asyncio.sleep(0.05)
        await engine.swap_model(tiny_models["llama"][0], mode="drain", abort=True)
        outs = await asyncio.gather(*old)
        assert all(o.finish_reason == "abort" and len(o.token_ids) < 200 for o in outs)
        assert (await engine.generate(PROMPTS[9], greedy(MAX_TOKENS))).token_ids == expected["llama"][9]
    gc.collect()
    assert old_core() is None


async def test_a_request_sent_once_a_drain_mode_swap_is_called_waits_for_the_new_version(tiny_models, expected) -> None:
    """Admission paused only once the old version began to drain, after the new one's memory check (a worker
    thread): a request sent meanwhile went to the old version, so with ``abort=True`` it was aborted with the
    old version's requests, though docs/model_swaps.md says requests arriving during the swap wait."""
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE)
    async with engine:
        old = asyncio.create_task(engine.generate(PROMPTS[0], greedy(200)))
        await asyncio.sleep(0.05)
        swap = asyncio.create_task(engine.swap_model(tiny_models["qwen2"][0], mode="drain", abort=True))
        await asyncio.sleep(0)  # the swap has begun: it is checking the new version's memory off the loop
        new = asyncio.create_task(engine.generate(PROMPTS[1], greedy(MAX_TOKENS)))
        await swap
        assert (await old).finish_reason == "abort"
        out = await new
        assert (out.finish_reason, out.token_ids) == ("length", expected["qwen2"][1])
        # A drain-mode swap refused by its memory check pauses nothing for good: requests are admitted again.
        with pytest.raises(ConfigurationError):
            await engine.swap_model(tiny_models["llama"][0], mode="drain", available_bytes=1 << 30, kv_cache_memory=1 << 40)
        assert (await engine.generate(PROMPTS[2], greedy(MAX_TOKENS))).token_ids == expected["qwen2"][2]


async def test_failed_drain_mode_swap_reloads_the_old_version(tiny_models, expected, tmp_path) -> None:
    engine = AsyncEngine.from_pretrained(tiny_models["qwen2"][0], **ENGINE_BASE)
    bad = tmp_path / "bad-weights"
    shutil.copytree(tiny_models["llama"][0], bad)
    (bad / "model.safetensors").write_bytes(b"garbage")
    async with engine:
        with pytest.raises(SwapError):
            await engine.swap_model(bad, mode="drain")
        (info,) = engine.model_info()
        assert info.state == "current" and "tiny-qwen2" in info.source
        out = await engine.generate(PROMPTS[3], greedy(MAX_TOKENS))
    assert out.token_ids == expected["qwen2"][3]


async def test_swap_before_start_and_after_close(tiny_models, expected) -> None:
    from asyncinfer import EngineClosedError

    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE)
    old_model = weakref.ref(engine.core.runner.model)
    info = await engine.swap_model(tiny_models["qwen2"][0])
    gc.collect()
    assert old_model() is None and [v.version_id for v in engine.model_info()] == [info.version_id]
    async with engine:
        out = await engine.generate(PROMPTS[5], greedy(MAX_TOKENS))
    assert out.token_ids == expected["qwen2"][5]
    with pytest.raises(EngineClosedError):
        await engine.swap_model(tiny_models["llama"][0])


def test_after_a_drain_swap_whose_reload_failed_too_a_request_is_refused_not_spun_on(tiny_models, monkeypatch) -> None:
    """docs/model_swaps.md: if the old version's reload fails too, no version serves and requests raise
    EngineClosedError. The request's admission loop waited on an event already set (the swap's end): it spun
    without yielding, and the event loop froze. Run on a thread of its own, so that a freeze fails the test."""
    from asyncinfer import EngineClosedError, swaps

    def no_load(*args, **kwargs):
        raise RuntimeError("out of memory")

    async def main() -> str:
        engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE)
        await engine.start()
        monkeypatch.setattr(swaps, "load", no_load)
        with pytest.raises(RuntimeError):
            await engine.swap_model(tiny_models["qwen2"][0], mode="drain")
        try:
            await engine.generate(PROMPTS[0], greedy(4))
        except EngineClosedError as exc:
            return str(exc)
        finally:
            await engine.aclose(abort=True)
        return "served"

    said: list[str] = []
    thread = threading.Thread(target=lambda: said.append(asyncio.run(main())), daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the event loop froze: the request spun on the admission of a finished swap"
    assert said and "no model version is serving" in said[0], said


async def test_after_a_drain_swap_whose_reload_failed_too_the_error_says_how_to_load_one(tiny_models, expected,
                                                                                        monkeypatch) -> None:
    """pass69: the refusal then said "(a drain-mode swap is loading the next one)" while nothing loaded, and every
    later swap_model was refused so: it names what happened and the calls that load a model again, which do."""
    from asyncinfer import EngineClosedError, swaps

    real_load = swaps.load
    failures = iter(range(2))

    def failing_twice(*args, **kwargs):
        if next(failures, None) is not None:
            raise SwapError("out of memory")
        return real_load(*args, **kwargs)

    llama, qwen2 = tiny_models["llama"][0], tiny_models["qwen2"][0]
    async with AsyncEngine.from_pretrained(llama, **ENGINE_BASE) as engine:
        monkeypatch.setattr(swaps, "load", failing_twice)
        with pytest.raises(SwapError):
            await engine.swap_model(qwen2, mode="drain")
        said = ("no model version is serving (a drain-mode swap failed to load its new version and the reload of "
                "the old one failed too: remove_model('default'), then add_model('default', model) loads one)")
        for call in (engine.generate(PROMPTS[0], greedy(4)), engine.swap_model(qwen2)):
            with pytest.raises(EngineClosedError) as refused:
                await call
            assert str(refused.value) == said
        await engine.remove_model("default")
        await engine.add_model("default", llama)
        out = await engine.generate(PROMPTS[0], greedy(MAX_TOKENS))
    assert out.token_ids == expected["llama"][0]
