"""A sixteenth stranger's first scheduler plugin (docs/schedulers.md, "Writing one"): a ``schedule()`` that raises
during the load's warm-up is named, not read as the model file's fault."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncinfer import AsyncEngine, ModelLoadError
from asyncinfer.schedulers import FIFOScheduler, SchedulerOutput
from tests.helpers import ENGINE_BASE


class Raises(FIFOScheduler):
    """A first plugin with a bug: a key its ``schedule()`` never set."""

    api_version = 1

    def schedule(self) -> SchedulerOutput:
        raise KeyError("budget")


class RaisesInABaseHelper(FIFOScheduler):
    """A plugin whose bug surfaces inside a base-class helper it calls (its own frame is on the stack)."""

    api_version = 1

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.admit_waiting(list(self.waiting), "512", out)  # type: ignore[arg-type]  # a budget read as a string
        return out


def test_a_schedule_that_raises_during_warm_up_is_named(tiny_models) -> None:
    """It was ``ModelLoadError: loading 'DIR' failed: 'budget'`` (the CLI: ``asyncinfer: error: loading
    'tiny.gguf' failed: 'budget'``): nothing named the scheduler, and it read as the model's fault."""
    path = tiny_models["llama"][0]
    with pytest.raises(ModelLoadError) as err:
        AsyncEngine.from_pretrained(path, **ENGINE_BASE, scheduler=Raises)
    assert str(err.value) == (
        f"loading {str(path)!r} failed: the scheduler Raises raised KeyError: 'budget' during warm-up, in its own "
        f"code ({Path(__file__).resolve()}): the load is refused (docs/schedulers.md, \"When it goes wrong\")")
    assert isinstance(err.value.__cause__, RuntimeError)
    assert isinstance(err.value.__cause__.__cause__, KeyError)


def test_a_fault_in_a_base_helper_the_plugin_called_is_the_plugin_s(tiny_models) -> None:
    with pytest.raises(ModelLoadError, match=r"failed: the scheduler RaisesInABaseHelper raised TypeError: .* during "
                                             r"warm-up, in its own code \(.*test_stranger16\.py\)"):
        AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE, scheduler=RaisesInABaseHelper)


def test_a_fault_outside_the_plugin_keeps_its_own_message(tiny_models, monkeypatch: pytest.MonkeyPatch) -> None:
    """The attribution is by the plugin's own source on the stack: a fault of the model's forward pass during the
    warm-up (a built-in scheduler, no plugin frame) reads as before."""
    from asyncinfer.runner import ModelRunner

    def broken_run(self: ModelRunner, inputs: object) -> None:
        raise RuntimeError("forward exploded")

    monkeypatch.setattr(ModelRunner, "run", broken_run)
    path = tiny_models["llama"][0]
    with pytest.raises(ModelLoadError) as err:
        AsyncEngine.from_pretrained(path, **ENGINE_BASE)
    assert str(err.value) == f"loading {str(path)!r} failed: forward exploded"


class ReturnsADict(FIFOScheduler):
    """A first plugin that returns its plan as a plain dict."""

    api_version = 1

    def schedule(self) -> SchedulerOutput:
        return {"num_scheduled_tokens": {}}  # type: ignore[return-value]


def test_a_schedule_that_returns_no_scheduler_output_is_named(tiny_models) -> None:
    """It was ``loading 'DIR' failed: 'dict' object has no attribute 'num_scheduled_tokens'``: the engine's words
    about a plugin's return value, naming neither."""
    path = tiny_models["llama"][0]
    with pytest.raises(ModelLoadError) as err:
        AsyncEngine.from_pretrained(path, **ENGINE_BASE, scheduler=ReturnsADict)
    assert str(err.value) == (f"loading {str(path)!r} failed: the scheduler ReturnsADict's schedule() returned dict, "
                              "not a SchedulerOutput (docs/schedulers.md)")


class RefusesItsOption(FIFOScheduler):
    """A plugin that checks its own option's value and raises a plain ValueError, as Python code does."""

    api_version = 1

    def __init__(self, config: object, kv: object, weight: float = 1.0) -> None:
        if weight <= 0:
            raise ValueError("weight must be positive")
        super().__init__(config, kv)  # type: ignore[arg-type]


def test_a_plugin_constructor_that_refuses_its_option_is_named(tiny_models) -> None:
    """It was ``ModelLoadError: loading 'DIR' failed: weight must be positive``: neither the scheduler nor the
    option named, and after the weights were read it read as the model's fault. Now the options' own typed error,
    the class and its file named and the plugin's error chained."""
    from asyncinfer import InvalidParameterError

    with pytest.raises(InvalidParameterError) as err:
        AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE, scheduler=RefusesItsOption,
                                    scheduler_options={"weight": -1})
    assert err.value.parameter == "scheduler_options"
    assert str(err.value) == (
        "scheduler_options={'weight': -1} is invalid: allowed options RefusesItsOption "
        f"({__name__}.RefusesItsOption in {__file__}) accepts: its constructor raised ValueError: weight must be "
        "positive")
    assert isinstance(err.value.__cause__, ValueError)
    # the same class with a value it takes loads and serves
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE, scheduler=RefusesItsOption,
                                         scheduler_options={"weight": 2.0})
    assert type(engine.core.scheduler) is RefusesItsOption


class PluginStop(BaseException):
    """A plugin's own BaseException subclass (neither SystemExit nor KeyboardInterrupt)."""


class StopsInWarmUp(FIFOScheduler):
    api_version = 1

    def schedule(self) -> SchedulerOutput:
        raise PluginStop("warm")


class StopsInItsConstructor(FIFOScheduler):
    api_version = 1

    def __init__(self, config, kv, *, x: int = 0) -> None:
        super().__init__(config, kv)  # type: ignore[arg-type]
        raise PluginStop("ctor")


def test_a_plugins_base_exception_in_the_load_is_named_as_its_exception_is(tiny_models) -> None:
    """A ``BaseException`` subclass of the plugin's own from ``schedule()`` in the warm-up, or from its constructor,
    escaped ``load`` bare (the CLI: a traceback), where a ``KeyError`` or ``ValueError`` is named: they are the
    plugin's faults as any exception but SystemExit and KeyboardInterrupt is."""
    from asyncinfer import InvalidParameterError

    path = tiny_models["llama"][0]
    with pytest.raises(ModelLoadError, match="the scheduler StopsInWarmUp raised PluginStop: warm during warm-up"):
        AsyncEngine.from_pretrained(path, **ENGINE_BASE, scheduler=StopsInWarmUp)
    with pytest.raises(InvalidParameterError) as err:
        AsyncEngine.from_pretrained(path, **ENGINE_BASE, scheduler=StopsInItsConstructor, scheduler_options={"x": 1})
    assert err.value.parameter == "scheduler_options"
    assert str(err.value).endswith("accepts: its constructor raised PluginStop: ctor")
    assert isinstance(err.value.__cause__, PluginStop)
