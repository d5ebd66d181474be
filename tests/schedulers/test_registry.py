"""The registry: names, classes, dotted paths, entry points, options, API version."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from asyncinfer import EngineConfig, InvalidParameterError
from asyncinfer.cache import KVCacheManager
from asyncinfer.schedulers import (
    ENTRY_POINT_GROUP,
    SCHEDULER_API_VERSION,
    AgingPriorityScheduler,
    FIFOScheduler,
    LengthBucketScheduler,
    PDSplitScheduler,
    Scheduler,
    SchedulerConfig,
    available_schedulers,
    builtin_schedulers,
    check_scheduler_options,
    create_scheduler,
    resolve_scheduler,
)


def kv() -> KVCacheManager:
    return KVCacheManager(16, 4)


def test_builtin_names() -> None:
    assert builtin_schedulers() == ["fifo", "length-bucket", "aging-priority", "pd-split"]
    assert resolve_scheduler("fifo") is FIFOScheduler
    assert resolve_scheduler("length-bucket") is LengthBucketScheduler
    assert resolve_scheduler("aging-priority") is AgingPriorityScheduler
    assert resolve_scheduler("pd-split") is PDSplitScheduler
    assert set(builtin_schedulers()) <= set(available_schedulers())
    assert [resolve_scheduler(n).uses_priority for n in builtin_schedulers()] == [False, False, True, False]


def test_class_and_dotted_path() -> None:
    assert resolve_scheduler(PDSplitScheduler) is PDSplitScheduler
    assert resolve_scheduler("asyncinfer.schedulers.pd_split:PDSplitScheduler") is PDSplitScheduler
    for bad in ("no-such-policy", "asyncinfer.nowhere:X", "asyncinfer.schedulers:NoSuchClass", 42, dict):
        with pytest.raises(InvalidParameterError, match="scheduler"):
            resolve_scheduler(bad)


def test_a_plugin_for_a_newer_api_is_refused() -> None:
    class FromTheFuture(FIFOScheduler):
        api_version = SCHEDULER_API_VERSION + 1

    with pytest.raises(InvalidParameterError, match="scheduler API"):
        resolve_scheduler(FromTheFuture)


def test_options_reach_the_constructor_and_are_checked() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=256)
    assert create_scheduler("pd-split", cfg, kv()).prefill_budget == 64  # default: a quarter of the budget
    assert create_scheduler("pd-split", cfg, kv(), {"prefill_budget": 7}).prefill_budget == 7
    sched = create_scheduler("aging-priority", cfg, kv(), {"aging_interval": None})
    assert sched.starvation_free is False and AgingPriorityScheduler.starvation_free is True
    with pytest.raises(InvalidParameterError, match="scheduler_options"):
        create_scheduler("fifo", cfg, kv(), {"prefill_budget": 7})
    with pytest.raises(InvalidParameterError, match="prefill_budget"):
        create_scheduler("pd-split", cfg, kv(), {"prefill_budget": 0})
    with pytest.raises(InvalidParameterError, match="aging_interval"):
        create_scheduler("aging-priority", cfg, kv(), {"aging_interval": -1})
    with pytest.raises(InvalidParameterError, match="bucket_edges"):
        create_scheduler("length-bucket", cfg, kv(), {"bucket_edges": [64, 32]})
    with pytest.raises(InvalidParameterError, match="enable_chunked_prefill"):
        create_scheduler("pd-split", SchedulerConfig(enable_chunked_prefill=False), kv())


def test_an_option_a_scheduler_does_not_take_is_refused_with_the_ones_it_does() -> None:
    """The refusal said only "allowed keywords X accepts (got an unexpected keyword argument ...)": a plugin
    author or an operator mistyping an option had to read the class to find its name."""

    class Weighted(FIFOScheduler):
        def __init__(self, config, kv, *, weights=None, floor: int = 1) -> None:
            super().__init__(config, kv)

    cases = [(Weighted, {"wieghts": {}}, "keywords Weighted accepts: weights, floor ("),
             ("pd-split", {"bogus": 1}, "keywords PDSplitScheduler accepts: prefill_budget ("),
             ("fifo", {"prefill_budget": 7}, "keywords FIFOScheduler accepts: none (")]
    for spec, options, said in cases:
        with pytest.raises(InvalidParameterError) as info:
            check_scheduler_options(spec, options)
        assert info.value.parameter == "scheduler_options" and info.value.allowed.startswith(said), info.value.allowed


def test_engine_config_checks_scheduler_options() -> None:
    assert EngineConfig(device="cpu", scheduler_options={"x": 1}).scheduler_options == {"x": 1}
    for bad in ([("x", 1)], {1: 2}, "x=1"):
        with pytest.raises(InvalidParameterError, match="scheduler_options"):
            EngineConfig(device="cpu", scheduler_options=bad)


def test_entry_point_of_an_installed_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real (temporary) distribution on sys.path declares a scheduler in the entry-point group."""
    (tmp_path / "acme_sched.py").write_text(textwrap.dedent("""
        from asyncinfer.schedulers import FIFOScheduler

        class AcmeScheduler(FIFOScheduler):
            pass
    """))
    info = tmp_path / "acme_sched-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-sched\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nacme = acme_sched:AcmeScheduler\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "acme" in available_schedulers()
    cls = resolve_scheduler("acme")
    assert cls.__name__ == "AcmeScheduler" and issubclass(cls, Scheduler)
    assert isinstance(create_scheduler("acme", SchedulerConfig(), kv()), FIFOScheduler)
    sys.modules.pop("acme_sched", None)


def test_engine_takes_scheduler_and_options(tiny_llama: Path) -> None:
    from asyncinfer import AsyncEngine

    base = {"kv_cache_memory": 1 << 20, "max_model_len": 64, "device": "cpu", "dtype": "float32"}
    engine = AsyncEngine.from_pretrained(tiny_llama, **base, scheduler="pd-split", scheduler_options={"prefill_budget": 9})
    assert isinstance(engine.core.scheduler, PDSplitScheduler) and engine.core.scheduler.prefill_budget == 9
    with pytest.raises(InvalidParameterError, match="scheduler_options"):
        AsyncEngine.from_pretrained(tiny_llama, **base, scheduler="fifo", scheduler_options={"nope": 1})
