"""An adversarial pass (pass45) on asyncinfer's errors crossing a process.

docs/api.md: each error "pickles and copies as itself, its attributes included, so one raised in another process
(a ``ProcessPoolExecutor`` worker, a Ray task or replica) is caught there by its type". Not one holding a value
pickle cannot write: ``InvalidParameterError.value`` is what the caller passed, and a generator given as
``SamplingParams(stop=...)`` (a mistake the error is there to name) made the error itself unpicklable, so the
worker pool's caller got ``TypeError: cannot pickle 'generator' object`` in its place, and ``copy.deepcopy`` of it
raised the same. Such an attribute goes as its repr now; a copy keeps it (a deep copy shares it).
"""

from __future__ import annotations

import concurrent.futures
import copy
import multiprocessing
import pickle
import threading

import pytest

from asyncinfer import InvalidParameterError, ModelLoadError, SamplingParams


def _refused_stop() -> InvalidParameterError:
    with pytest.raises(InvalidParameterError) as err:
        SamplingParams(stop=(s for s in ["a", "b"]))
    return err.value


def test_an_error_holding_a_generator_pickles_as_itself_with_its_repr() -> None:
    error = _refused_stop()
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is InvalidParameterError and str(again) == str(error)
    assert again.parameter == "stop" and again.allowed == error.allowed
    assert again.value == repr(error.value)[:240]


def test_a_worker_pools_caller_catches_it_by_type() -> None:
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
        with pytest.raises(InvalidParameterError) as err:
            pool.submit(eval, "SamplingParams(stop=(s for s in 'ab'))", {"SamplingParams": SamplingParams}).result(
                timeout=120)
        assert err.value.parameter == "stop" and "generator" in err.value.value


def test_copies_keep_each_attribute_itself() -> None:
    error = _refused_stop()
    assert copy.copy(error).value is error.value
    lock = threading.Lock()
    held = InvalidParameterError("lock", lock, "no lock")
    deep = copy.deepcopy(held)  # a lock has no deep copy: shared
    assert type(deep) is InvalidParameterError and deep.parameter == "lock" and deep.value is lock
    assert copy.deepcopy(error).value is error.value


def test_an_error_holding_itself_rebuilds() -> None:
    error = ModelLoadError("cycle")
    error.held = [error]
    again = pickle.loads(pickle.dumps(error))
    assert again.held[0] is again
    deep = copy.deepcopy(error)
    assert deep.held[0] is deep


class Missing(ModelLoadError, FileNotFoundError):
    """An error class of a user's own, also an OSError."""


@pytest.mark.parametrize("rebuild", [lambda e: pickle.loads(pickle.dumps(e)), copy.copy, copy.deepcopy],
                         ids=["pickle", "copy", "deepcopy"])
def test_an_error_class_that_is_also_an_oserror_rebuilds(rebuild) -> None:
    error = Missing("model path 'x' does not exist")
    error.path = "x"
    again = rebuild(error)
    assert type(again) is Missing and str(again) == str(error) and again.path == "x"
