"""A newcomer's first hour (stranger 18): ``register_scheduler`` checks the name and the class it is given."""

from __future__ import annotations

import pytest

from asyncinfer import InvalidParameterError
from asyncinfer.schedulers import FIFOScheduler, Scheduler, available_schedulers, register_scheduler
from asyncinfer.schedulers.registry import registered_schedulers, resolve_scheduler


class Mine(FIFOScheduler):
    pass


class Other(FIFOScheduler):
    pass


@pytest.fixture(autouse=True)
def _forget_registrations(forget_registrations):
    """Every test here registers schedulers: conftest's forget_registrations undoes them."""


def test_a_built_in_name_is_not_replaced() -> None:
    """``@register_scheduler("fifo")`` replaced FIFO for every engine of the process, silently."""
    with pytest.raises(InvalidParameterError) as caught:
        register_scheduler("fifo")(Mine)
    assert str(caught.value) == ("name='fifo' is invalid: allowed a name that is not a built-in scheduler's "
                                 "(['fifo', 'length-bucket', 'aging-priority', 'pd-split'])")
    assert resolve_scheduler("fifo") is FIFOScheduler


@pytest.mark.parametrize("name", [5, "", "   ", None, "x" * 201])
def test_a_name_that_is_no_name_is_refused(name) -> None:
    """An int was registered, and then available_schedulers() (the lab's, the error messages') raised
    ``TypeError: '<' not supported between instances of 'int' and 'str'``."""
    with pytest.raises(InvalidParameterError) as caught:
        register_scheduler(name)
    assert caught.value.parameter == "name" and caught.value.allowed == "a non-empty string of at most 200 characters"
    assert available_schedulers() == sorted(["fifo", "length-bucket", "aging-priority", "pd-split",
                                             *registered_schedulers()])


@pytest.mark.parametrize("thing", [object, int, lambda: None, object.__new__(Mine)], ids=["object", "int", "function", "instance"])
def test_what_is_no_scheduler_class_is_refused_when_registered(thing) -> None:
    """It was registered, and refused only when an engine was built with its name."""
    with pytest.raises(InvalidParameterError) as caught:
        register_scheduler("mine")(thing)
    assert caught.value.parameter == "scheduler" and caught.value.value is thing
    assert caught.value.allowed == "a subclass of asyncinfer.schedulers.Scheduler (registering 'mine')"
    assert "mine" not in registered_schedulers()


def test_registering_a_name_again_replaces_its_class() -> None:
    """A module or a notebook cell run twice registers again: allowed, the later class wins."""
    assert register_scheduler("mine")(Mine) is Mine
    assert register_scheduler("mine")(Other) is Other
    assert resolve_scheduler("mine") is Other and issubclass(Other, Scheduler)
