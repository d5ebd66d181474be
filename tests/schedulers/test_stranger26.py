"""A newcomer's first hour (stranger 26): a scheduler plugin written from docs/schedulers.md with a small mistake.

- A constructor that takes an option and forgets ``super().__init__(config, kv)``: the queues every hook reads
  were never made, so the engine's load failed with ``loading the default model (...) failed: 'Forgetful' object
  has no attribute 'requests'`` (the model's fault, by the message) and ``asyncinfer lab`` with ``asyncinfer:
  internal error: AttributeError: ...`` (asyncinfer's, status 1). ``create_scheduler`` now refuses such a class as
  the ``scheduler`` when it builds it, naming the call it left out.
- An ``OrderedScheduler`` whose ``key_of`` raises (a misspelt ``request.prompt_len``): the lab called it from
  ``add_request`` outside the guard ``schedule()`` has, so it was an internal error too; it is the plugin's broken
  contract now (status 2), as a ``schedule()`` that raises is (docs/schedulers.md, "Progress").
"""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncinfer import InvalidParameterError, cli
from asyncinfer.cache import KVCacheManager
from asyncinfer.schedulers import SchedulerConfig
from asyncinfer.schedulers.registry import create_scheduler

PLUGIN = '''
from asyncinfer.schedulers import FIFOScheduler, OrderedScheduler, SchedulerOutput


class Forgetful(FIFOScheduler):  # its own option, and no super().__init__(config, kv)
    def __init__(self, config, kv, *, weight=1):
        self.weight = weight


class Misspelt(OrderedScheduler):  # the docs' shortest-first-ordered with a wrong attribute in key_of
    uses_priority = False
    starvation_free = False

    def lane_of(self, request):
        return 0

    def key_of(self, request):
        return request.prompt_len + request.params.max_tokens

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self.admit_waiting(self.waiting_in(0), budget, out)
        return out


class Counting(FIFOScheduler):  # counts what finished, in a counter it never made
    def finish_requests(self, requests):
        for _ in requests:
            self.finished += 1
        super().finish_requests(requests)
'''


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "s26_policies.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "s26_policies"


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.rstrip("\n")


def test_a_constructor_without_super_init_is_refused_as_the_scheduler(plugin: str) -> None:
    with pytest.raises(InvalidParameterError) as info:
        create_scheduler(f"{plugin}:Forgetful", SchedulerConfig(), KVCacheManager(8, 4), {"weight": 2})
    assert info.value.parameter == "scheduler"
    assert str(info.value) == (
        "scheduler='s26_policies:Forgetful' is invalid: allowed a class whose constructor calls "
        "super().__init__(config, kv) (Forgetful's returned without it: no config, kv, waiting, running, requests)")


def test_lab_names_a_constructor_without_super_init(plugin: str, capsys) -> None:
    assert cli.main(["lab", "--schedulers", f"{plugin}:Forgetful", "--synthetic", "5"]) == 2
    assert _error_line(capsys) == (
        "asyncinfer: error: --schedulers 's26_policies:Forgetful' is invalid: allowed a class whose constructor "
        "calls super().__init__(config, kv) (Forgetful's returned without it: no config, kv, waiting, running, "
        "requests)")


def test_lab_names_a_key_of_that_raises_as_the_plugin_s_fault(plugin: str, capsys) -> None:
    assert cli.main(["lab", "--schedulers", f"{plugin}:Misspelt", "--synthetic", "5"]) == 2
    assert _error_line(capsys) == (
        "asyncinfer: error: scheduler Misspelt broke the scheduler contract (docs/schedulers.md): at step 0 "
        "(0.000s): add_request('r0') raised AttributeError: 'Request' object has no attribute 'prompt_len'")


def test_simulate_chains_the_hook_s_exception(plugin: str) -> None:
    from asyncinfer.lab import ContractViolation, simulate, synthetic_trace

    with pytest.raises(ContractViolation, match=r"^Misspelt at step 0 \(0\.000s\): add_request\(.r0.\) raised Attr") as info:
        simulate(synthetic_trace(3, seed=0), f"{plugin}:Misspelt")
    assert isinstance(info.value.__cause__, AttributeError)


def test_the_documented_examples_still_build() -> None:
    from asyncinfer.schedulers import FIFOScheduler, OrderedScheduler

    class ShortestFirstOrdered(OrderedScheduler):
        uses_priority = False
        starvation_free = False

        def lane_of(self, request):
            return 0

        def key_of(self, request):
            return request.num_prompt_tokens + request.params.max_tokens

        def schedule(self):  # pragma: no cover - only built here
            raise NotImplementedError

    class Weighted(FIFOScheduler):
        def __init__(self, config, kv, *, weight=1):
            super().__init__(config, kv)
            self.weight = weight

    assert isinstance(create_scheduler(ShortestFirstOrdered, SchedulerConfig(), KVCacheManager(8, 4)),
                      ShortestFirstOrdered)
    assert create_scheduler(Weighted, SchedulerConfig(), KVCacheManager(8, 4), {"weight": 3}).weight == 3


def test_the_conformance_suite_no_longer_asks_about_super_init(plugin: str) -> None:
    """Its hint for a hook that raises asked "does its __init__ call super().__init__(config, kv)?", which the
    construction now answers; for a misspelt attribute in ``key_of`` the question sent the reader astray."""
    from asyncinfer.conformance import ContractViolation, check_scheduler

    with pytest.raises(ContractViolation) as info:
        check_scheduler(f"{plugin}:Misspelt", engine=False)
    assert str(info.value) == (f"{plugin}:Misspelt (seed 0, limits num_blocks=256, block_size=4, max_num_seqs=8, "
                               "max_num_batched_tokens=64) step 2: add_request('a/5') raised AttributeError: 'Request' "
                               "object has no attribute 'prompt_len' (do its methods keep the base class's signatures?)")


def test_lab_names_a_finish_requests_that_raises_as_the_plugin_s_fault(plugin: str, capsys) -> None:
    """The hooks the step's outputs call (``finish_requests``, ``add_forked``) were outside the guard too."""
    assert cli.main(["lab", "--schedulers", f"{plugin}:Counting", "--synthetic", "5"]) == 2
    line = _error_line(capsys)
    assert line.startswith("asyncinfer: error: scheduler Counting broke the scheduler contract (docs/schedulers.md): "
                           "at step "), line
    assert line.endswith("applying the step (its finish_requests and add_forked hooks) raised AttributeError: "
                         "'Counting' object has no attribute 'finished'"), line
