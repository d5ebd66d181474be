"""Loading leaves no OpenMP team on the caller's thread (asyncinfer.threads, benchmarks/threads.py)."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from asyncinfer import AsyncEngine, on_own_thread

OPTIONS = {"kv_cache_memory": 4 * 2**20, "max_model_len": 128}


def test_on_own_thread_returns_on_a_thread_that_has_ended() -> None:
    seen: list[threading.Thread] = []

    def work(a: int, *, b: int) -> int:
        seen.append(threading.current_thread())
        return a + b

    assert on_own_thread(work, 2, b=3) == 5
    assert seen[0] is not threading.current_thread() and seen[0].name == "asyncinfer-own-thread"
    assert not seen[0].is_alive()


def test_on_own_thread_passes_every_keyword_and_the_callers_modes_on() -> None:
    import contextvars

    import torch

    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")

    def state(*, name: str, fn: str) -> tuple[str, str, bool, bool, str]:
        return name, fn, torch.is_grad_enabled(), torch.is_inference_mode_enabled(), var.get()

    var.set("the caller's")
    assert on_own_thread(state, name="alice", fn="f") == ("alice", "f", True, False, "the caller's")
    with torch.no_grad():
        assert on_own_thread(state, name="a", fn="f")[2:4] == (False, False)
    with torch.inference_mode():
        assert on_own_thread(state, name="a", fn="f")[2:4] == (False, True)


def test_on_own_thread_raises_the_calls_exception() -> None:
    def fail() -> None:
        raise KeyError("the cause")

    with pytest.raises(KeyError, match="the cause"):
        on_own_thread(fail)


def test_the_load_and_the_bandwidth_probe_run_on_threads_that_end(tiny_models, monkeypatch) -> None:
    from asyncinfer import loading
    from asyncinfer.metrics import engine_metrics

    threads: dict[str, threading.Thread] = {}
    warm_up, probe = loading.warm_up, engine_metrics.measure_memory_bandwidth

    def spy_warm_up(core, stall_timeout=None):
        threads["load"] = threading.current_thread()
        return warm_up(core, stall_timeout)

    def spy_probe(device):
        threads["bandwidth"] = threading.current_thread()
        return probe(device)

    monkeypatch.setattr(loading, "warm_up", spy_warm_up)
    monkeypatch.setattr(engine_metrics, "measure_memory_bandwidth", spy_probe)
    AsyncEngine.from_pretrained(str(tiny_models["llama"][0]), **OPTIONS)
    assert set(threads) == {"load", "bandwidth"}
    for thread in threads.values():
        assert thread is not threading.current_thread() and not thread.is_alive()


# Counts the process's threads around a load, in a fresh process whose main thread has run no
# parallel torch op: an OpenMP team left on the main thread is one more (worker) thread.
COUNT = textwrap.dedent("""
    import os, sys, time
    import torch
    with open("/proc/self/maps") as maps:
        if "libgomp" not in maps.read():
            print("no-libgomp")
            sys.exit(0)
    torch.set_num_threads(2)
    from asyncinfer import loading
    from asyncinfer import AsyncEngine
    path, mode = sys.argv[1], sys.argv[2]
    options = dict(kv_cache_memory=4 * 2**20, max_model_len=128)
    before = len(os.listdir("/proc/self/task"))
    if mode == "engine":
        AsyncEngine.from_pretrained(path, **options)
    else:  # the load's own body, on this thread: what from_pretrained did before
        loading._load(path, options, version_id=0, kind=None, error=loading.ModelLoadError, what=None)
    # The workers of a team whose thread ended leave shortly after it: wait for them (3 s at most).
    deadline = time.monotonic() + 3
    while len(os.listdir("/proc/self/task")) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    print(len(os.listdir("/proc/self/task")) - before)
""")


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in Linux's /proc")
def test_from_pretrained_leaves_the_callers_thread_without_an_openmp_team(tiny_models) -> None:
    path = str(tiny_models["llama"][0])

    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}  # libgomp's defaults

    def added_threads(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", COUNT, path, mode], capture_output=True, text=True, check=True,
                             env=env)
        if out.stdout.split()[-1] == "no-libgomp":
            pytest.skip("torch here does not use GNU libgomp, whose per-thread teams this counts")
        return int(out.stdout.split()[-1])

    assert added_threads("engine") == 0
    assert added_threads("caller") == 1  # the same load on the caller's thread leaves a worker: the count sees it


def test_a_failed_call_leaves_nothing_alive_behind_its_exception() -> None:
    """The re-raised exception does not hold the call's frames in a cycle: with the cyclic
    collector off, what the failed call built is freed when the caller's handler ends."""
    import weakref

    refs = []

    class Big:
        pass

    def fail() -> None:
        big = Big()
        refs.append(weakref.ref(big))
        raise ValueError("failed")

    gc.disable()
    try:
        try:
            on_own_thread(fail)
        except ValueError:
            pass
        assert refs[0]() is None
    finally:
        gc.enable()


def test_num_threads_still_applies_on_the_callers_thread(tiny_models) -> None:
    import torch

    before = torch.get_num_threads()
    try:
        AsyncEngine.from_pretrained(str(tiny_models["llama"][0]), num_threads=1, **OPTIONS)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


# Ctrl-C while the caller waits: the call is interrupted too and unwinds before the caller raises. The child takes
# SIGINT as a terminal's shell gives it (Python's handler, unblocked): a suite started in the background of a
# non-interactive shell has it ignored, and a child inherits that (Python then installs no handler, and the Ctrl-C
# the test sends was lost: the call ran its 30 s).
INTERRUPT = textwrap.dedent("""
    import signal as _signal
    _signal.signal(_signal.SIGINT, _signal.default_int_handler)
    _signal.pthread_sigmask(_signal.SIG_UNBLOCK, [_signal.SIGINT])
    import threading, time
    from asyncinfer import on_own_thread
    seen = []
    def work():
        try:
            time.sleep(0.2)  # the caller is waiting by now
            print("started", flush=True)  # inside the try: a Ctrl-C from here on is seen
            for _ in range(600):
                time.sleep(0.05)
        except KeyboardInterrupt:
            seen.append("interrupted")
            raise
        seen.append("ran to its end")
    try:
        on_own_thread(work)
    except KeyboardInterrupt:
        print(seen, sorted(t.name for t in threading.enumerate()), flush=True)
""")


def test_ctrl_c_interrupts_the_call_and_waits_for_it() -> None:
    child = subprocess.Popen([sys.executable, "-c", INTERRUPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "started"
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=30)
    assert child.returncode == 0, err
    assert out.strip() == "['interrupted'] ['MainThread']"


# The kernel hands a process-directed SIGINT to whichever thread can take it: under load, sometimes the call's
# thread. Python only flags it there; the waiting caller must still see it (an untimed wait slept through it, and
# the call ran to its end: the suite's flaky Ctrl-C test). The signal is sent to the call's own thread here.
INTERRUPT_ON_THE_CALLS_THREAD = INTERRUPT.replace(
    'print("started", flush=True)',
    'signal.pthread_kill(threading.get_ident(), signal.SIGINT); print("started", flush=True)').replace(
    "import threading, time", "import signal, threading, time")


def test_ctrl_c_that_reaches_the_calls_thread_interrupts_the_call() -> None:
    assert "pthread_kill" in INTERRUPT_ON_THE_CALLS_THREAD
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", INTERRUPT_ON_THE_CALLS_THREAD], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.split("\n", 1)[1].strip() == "['interrupted'] ['MainThread']"
    assert time.monotonic() - started < 25  # the call's loop alone runs 30 s


async def _cancel_while_running(started: threading.Event, release: threading.Event, work) -> tuple[bool, str]:
    """The awaitable ``work`` as a task, cancelled once ``started`` is set (its work running in a worker thread):
    whether it had ended 0.3 s after the cancel, its work still held, and how it ended once ``release`` let the
    work go."""
    import asyncio

    task = asyncio.ensure_future(work)
    while not started.is_set():
        await asyncio.sleep(0.01)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=0.3)
    release.set()
    try:
        await task
    except asyncio.CancelledError:
        return bool(done), "cancelled"
    return bool(done), "returned"


def test_run_sync_to_end_holds_its_caller_until_the_work_ends_and_runs_nothing_once_left() -> None:
    """An asyncio cancel of a caller whose work runs in a worker thread is raised once the work has returned (the
    caller holds its place till then); one that comes before the work began ends the caller at once, the work
    never run. With anyio's ``run_sync`` the caller ended at once and its work ran on, its place given back."""
    import asyncio

    import anyio

    from asyncinfer.threads import run_sync_to_end

    started, release = threading.Event(), threading.Event()
    ran: list[str] = []

    def work(name: str) -> str:
        ran.append(name)
        started.set()
        assert release.wait(10)
        return name

    limiter = anyio.CapacityLimiter(1)
    try:
        ended = asyncio.run(_cancel_while_running(started, release, run_sync_to_end(work, "a", limiter=limiter)))
    finally:
        release.set()
    assert ended == (False, "cancelled")
    assert ran == ["a"] and limiter.borrowed_tokens == 0

    async def queued() -> list[object]:  # the second waits for the one place, is cancelled, and never runs
        started.clear()
        release.clear()
        first = asyncio.ensure_future(run_sync_to_end(work, "b", limiter=limiter))
        while not started.is_set():
            await asyncio.sleep(0.01)
        second = asyncio.ensure_future(run_sync_to_end(work, "c", limiter=limiter))
        await asyncio.sleep(0.05)
        second.cancel()
        done, _ = await asyncio.wait({second}, timeout=0.3)
        assert done, "a caller that left before its work began waited"
        release.set()
        return await asyncio.gather(first, second, return_exceptions=True)

    ends = asyncio.run(queued())
    assert ends[0] == "b" and isinstance(ends[1], asyncio.CancelledError)
    assert ran == ["a", "b"] and limiter.borrowed_tokens == 0
    assert asyncio.run(run_sync_to_end(work, "d")) == "d"  # anyio's shared pool


def test_run_sync_to_end_under_an_anyio_cancel_scope_waits_once_and_ends_in_the_scope() -> None:
    """anyio's ``move_on_after`` (a cancel scope) over work that runs: the caller waits for the work, woken once by
    the cancel, and the scope ends it there. The scope sends its cancel again at every turn of the loop while the
    task stays in it: the caller, catching each, was woken thousands of times (the loop spinning at 100% CPU till the
    work's end), and the cancel it raised last, a new one, was not the scope's: it went through ``move_on_after``."""
    import asyncio
    import types

    import anyio

    from asyncinfer.threads import run_sync_to_end

    started, release = threading.Event(), threading.Event()

    def work() -> str:
        started.set()
        assert release.wait(10)
        return "done"

    @types.coroutine
    def counting(coro, throws):  # type: ignore[no-untyped-def]  # the awaitable, counting what is thrown into it
        it, value, error = coro.__await__(), None, None
        while True:
            try:
                sent = it.send(value) if error is None else it.throw(error)
            except StopIteration as stop:
                return stop.value
            value, error = None, None
            try:
                value = yield sent
            except BaseException as exc:  # noqa: BLE001 - passed on to the awaitable
                throws.append(type(exc))
                error = exc

    async def run() -> tuple[bool, list[type], int]:
        throws: list[type] = []
        timer = threading.Timer(0.3, release.set)  # the work ends 0.3 s after it began, whatever the caller does

        def timed() -> str:
            timer.start()
            return work()

        with anyio.move_on_after(0.05) as scope:  # cancelled while the work runs
            await counting(run_sync_to_end(timed), throws)
        timer.join()
        return scope.cancelled_caught and started.is_set(), throws[:3], len(throws)

    try:
        assert asyncio.run(run()) == (True, [asyncio.CancelledError], 1)
    finally:
        release.set()


def test_a_call_cancelled_while_its_texts_are_tokenized_waits_for_the_tokenizing(minilm_dir, monkeypatch) -> None:
    """``embed()`` of texts long enough to be tokenized off the loop, cancelled while the tokenizer runs, ends once
    it has: it ended at once, the tokenizing running on in a worker thread that nothing held (a 3.2 MB call of
    short texts is 2.7 s of it), so a caller cancelling each such call ran any number at once."""
    import asyncio

    from asyncinfer.models.encoder import LoadedEncoder

    started, release = threading.Event(), threading.Event()
    tokenize = LoadedEncoder.tokenize

    def held(self, texts):  # type: ignore[no-untyped-def]
        started.set()
        assert release.wait(10)
        return tokenize(self, texts)

    async def run() -> tuple[bool, bool, str]:
        engine = await AsyncEngine.load(minilm_dir, device="cpu", dtype="float32")
        monkeypatch.setattr(LoadedEncoder, "tokenize", held)  # after the load's warm-up
        async with engine:
            # 80,000 characters: tokenized off the loop
            done, end = await _cancel_while_running(started, release, engine.embed(["word " * 2000] * 8))
            monkeypatch.setattr(LoadedEncoder, "tokenize", tokenize)
            vectors = await engine.embed("still serving")
        return done, vectors.shape == (1, 384), end

    try:
        assert asyncio.run(run()) == (False, True, "cancelled")
    finally:
        release.set()


def test_work_shares_give_each_party_its_few_threads_and_the_others_theirs(monkeypatch) -> None:
    """One party's many calls run ``per_party`` at a time, the rest waiting in order; another party's call runs at
    once beside them, in a pool the first party's calls would otherwise fill; a call cancelled while it waits for a
    place never runs; a party's entry goes with its last call."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from asyncinfer import threads
    from asyncinfer.threads import WORK_THREADS_PER_PARTY, WorkShares

    small = ThreadPoolExecutor(WORK_THREADS_PER_PARTY + 1)  # a small pool of work threads
    monkeypatch.setattr(threads, "_work_executor", small)

    release = threading.Event()
    ran: list[str] = []

    def held(name: str) -> str:
        ran.append(name)
        assert release.wait(10)
        return name

    async def scenario() -> None:
        shares = WorkShares()
        flood = [asyncio.ensure_future(shares.run("a", held, f"a{i}")) for i in range(6)]
        while shares.running("a") < WORK_THREADS_PER_PARTY:
            await asyncio.sleep(0.01)
        # the other party's call: it finds a thread though "a" has six calls to make
        assert await asyncio.wait_for(shares.run("b", str.upper, "b"), 5) == "B"
        assert shares.running("a") == WORK_THREADS_PER_PARTY and ran == ["a0", "a1"]
        flood[5].cancel()  # waiting for a place: it ends, and never runs
        await asyncio.wait({flood[5]}, timeout=1)
        assert flood[5].cancelled()
        assert await asyncio.wait_for(shares.run(None, str.lower, "N"), 5) == "n"  # no party: the pool as it comes
        release.set()
        assert await asyncio.gather(*flood[:5]) == ["a0", "a1", "a2", "a3", "a4"]
        assert sorted(ran) == ["a0", "a1", "a2", "a3", "a4"] and len(shares) == 0

    try:
        asyncio.run(scenario())
    finally:
        release.set()
        small.shutdown()


def test_work_threads_run_below_the_engines_os_priority() -> None:
    """The work threads (a flood's bodies decoded, its prompts tokenized) run ``WORK_THREAD_NICE`` below the process's
    priority: at the same priority they took the CPU from the engine thread's parallel regions, whose workers then
    waited their turn at every region (a neighbour's time per token 7 ms -> hundreds of ms)."""
    import asyncio
    import os

    from asyncinfer.threads import WORK_THREAD_NICE, WorkShares

    def priority() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    async def both() -> list[int]:
        shares = WorkShares()
        return [await shares.run("a", priority), await shares.run(None, priority)]

    base = priority()
    assert asyncio.run(both()) == [min(19, base + WORK_THREAD_NICE)] * 2
    assert priority() == base
