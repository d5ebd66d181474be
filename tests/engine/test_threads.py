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
