"""The conformance suite names a plugin's own exception as a broken contract, with the seed, limits and step."""

from __future__ import annotations

import pytest

from asyncinfer.schedulers import FIFOScheduler
from asyncinfer.schedulers.testing import ContractViolation, check_rules, drive_random_load


class RaisesOnceBusy(FIFOScheduler):
    """``schedule()`` raises a KeyError (no AttributeError or TypeError) once two requests run."""

    api_version = 1

    def schedule(self):
        out = super().schedule()
        if len(self.running) > 1:
            raise KeyError("budget")
        return out


def test_a_schedule_that_raises_is_a_contract_violation_naming_seed_limits_and_step() -> None:
    """It escaped bare (``KeyError: 'budget'``): neither the seed nor the limits nor the step that replay it."""
    with pytest.raises(ContractViolation) as info:
        check_rules(RaisesOnceBusy)
    assert str(info.value) == ("RaisesOnceBusy (seed 0, limits num_blocks=256, block_size=4, max_num_seqs=8, "
                               "max_num_batched_tokens=64) step 7: schedule() raised KeyError: 'budget'")
    assert isinstance(info.value.__cause__, KeyError)


def test_a_hook_that_raises_is_named_by_the_hook() -> None:
    class AbortFails(FIFOScheduler):
        api_version = 1

        def abort_request(self, request_id):
            raise LookupError(request_id)

    with pytest.raises(ContractViolation) as info:
        drive_random_load(AbortFails, 1)
    assert str(info.value) == ("AbortFails (seed 1, limits num_blocks=26, block_size=4, max_num_seqs=6, "
                               "max_num_batched_tokens=48) step 20: abort_request('a/5') raised LookupError: a/5")
