"""A stranger's first hour (stranger38): an asyncinfer error raised in another process.

docs/api.md: "every library error is an ``asyncinfer`` exception naming the parameter", caught by type
(``except PromptTooLongError:``, then trim and retry). Raised in another process, none of the errors whose
constructor takes more than a message arrived: Python rebuilds an unpickled exception by calling its class with
``args`` (the message alone), which ``InvalidParameterError(parameter, value, allowed)``, ``PromptTooLongError``,
``ModelChangedError`` and ``UnknownOptionError`` refuse. An ``EngineConfig(max_num_seqs=0)`` in a
``ProcessPoolExecutor`` worker ended in ``BrokenProcessPool: A process in the process pool was terminated
abruptly`` (the pool broken for every other task in it), a Ray task's or replica's in Ray's
``UnserializableException: Failed to deserialize exception`` (docs/scale_out.md: each replica embeds an engine and
checks its options as it loads), and ``copy.copy`` of such an error raised ``TypeError``. Every asyncinfer error
pickles and copies as itself now, its attributes included.

And ``trim_messages(history, budget, engine.count_tokens)`` (the docs' answer to a ``PromptTooLongError``) on a
history whose system prompt or last turn alone is longer than any prompt of the model may be (a pasted log as the
last message) raised ``count_tokens``' own ``PromptTooLongError`` naming ``prompt``, a parameter trim_messages
does not have, where its docstring promises an ``InvalidParameterError`` on ``messages``, as for a system prompt
and last turn over the budget by their tokens. It is that refusal now, the count's error chained.
"""

from __future__ import annotations

import concurrent.futures
import copy
import multiprocessing
import pickle

import pytest

from asyncinfer import (
    AsyncEngine,
    EngineConfig,
    EngineOverloadedError,
    InvalidParameterError,
    ModelChangedError,
    ModelLoadError,
    PromptTooLongError,
    SamplingParams,
    trim_messages,
)
from asyncinfer.config import UnknownOptionError

ERRORS = [
    InvalidParameterError("max_tokens", 300, "at most 255"),
    InvalidParameterError("model", None, "a model name", message="no model was named and ..."),
    PromptTooLongError("<300 tokens>", "at most max_model_len - 1 = 255 tokens"),
    UnknownOptionError("n_ctx", 4096, "an option of EngineConfig", EngineConfig),
    ModelChangedError("made for version 1", 1, 2),
    EngineOverloadedError("too many requests wait", retry_after=2.5),
    ModelLoadError("model path 'x.gguf' does not exist"),
]


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("rebuild", [lambda e: pickle.loads(pickle.dumps(e)), copy.copy, copy.deepcopy],
                         ids=["pickle", "copy", "deepcopy"])
def test_each_error_rebuilds_as_itself(error: Exception, rebuild) -> None:
    again = rebuild(error)
    assert type(again) is type(error) and str(again) == str(error) and again.args == error.args
    assert vars(again) == vars(error)


def test_a_worker_process_error_reaches_the_caller_by_type() -> None:
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
        with pytest.raises(InvalidParameterError) as err:
            pool.submit(EngineConfig, max_num_seqs=0, num_threads=1).result(timeout=120)
        assert err.value.parameter == "max_num_seqs" and err.value.value == 0
        assert pool.submit(EngineConfig, max_num_seqs=1).result(timeout=120).max_num_seqs == 1  # the pool serves on


async def test_an_engine_prompt_too_long_error_pickles_with_its_numbers(real_gguf) -> None:
    async with await AsyncEngine.load(real_gguf, max_model_len=64, device="cpu", num_threads=1) as engine:
        with pytest.raises(PromptTooLongError) as err:
            await engine.generate("hello world " * 40, SamplingParams(max_tokens=4))
    again = pickle.loads(pickle.dumps(err.value))
    assert isinstance(again, PromptTooLongError) and again.parameter == "prompt"
    assert again.allowed == err.value.allowed == "at most max_model_len - 1 = 63 tokens"


async def test_trim_messages_names_messages_when_the_last_turn_is_refused_by_its_size(real_gguf) -> None:
    async with await AsyncEngine.load(real_gguf, max_model_len=64, device="cpu", num_threads=1) as engine:
        for history in ([{"role": "system", "content": "x" * 10_000}, {"role": "user", "content": "hi"}],
                        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                         {"role": "user", "content": "x" * 10_000}]):
            with pytest.raises(InvalidParameterError) as err:
                trim_messages(history, 48, engine.count_tokens)
            assert not isinstance(err.value, PromptTooLongError) and err.value.parameter == "messages"
            assert err.value.allowed.startswith("a system prompt and last turn within 48 tokens (they are longer than "
                                                "any prompt of the model may be: at most max_model_len - 1 = 63 tokens")
            assert isinstance(err.value.__cause__, PromptTooLongError)
