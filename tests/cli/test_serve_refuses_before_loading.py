"""Option values the plan can judge are refused before ``asyncinfer serve`` prints its plan or loads anything.

A step budget smaller than the context with chunked prefill off, and a built-in scheduler's option value
(pd-split's ``prefill_budget=x``), were refused only once the server had started loading: the plan was printed,
then "Application startup failed", then the error (and the budget's error spelled the Python keyword)."""

from __future__ import annotations

import pytest

from asyncinfer import AsyncEngine, InvalidParameterError, cli


@pytest.mark.parametrize(("flags", "error"), [
    (["--no-enable-chunked-prefill", "--max-num-batched-tokens", "64", "--max-model-len", "128"],
     ("asyncinfer: error: --max-num-batched-tokens 64 is invalid: allowed >= max_model_len (128) while chunked "
      "prefill is off (a prompt must fit one step); or leave chunked prefill on\n")),
    (["--scheduler", "pd-split", "--scheduler-option", "prefill_budget=x"],
     "asyncinfer: error: --scheduler-option prefill_budget=x is invalid: allowed an integer >= 1\n"),
    (["--scheduler", "aging-priority", "--scheduler-option", "preempt=3"],
     "asyncinfer: error: --scheduler-option preempt=3 is invalid: allowed True or False\n"),
])
def test_serve_refuses_before_it_prints_or_loads(tiny_models, capsys, flags, error) -> None:
    assert cli.main(["serve", str(tiny_models["llama"][0]), "--port", "0", "--threads", "1", *flags]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == error, (out, err)


def test_plan_memory_refuses_them_too(tiny_models) -> None:
    path = tiny_models["llama"][0]
    with pytest.raises(InvalidParameterError) as caught:
        AsyncEngine.plan_memory(path, enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=128)
    assert caught.value.parameter == "max_num_batched_tokens"
    with pytest.raises(InvalidParameterError) as caught:
        AsyncEngine.plan_memory(path, scheduler="pd-split", scheduler_options={"prefill_budget": 0})
    assert caught.value.parameter == "prefill_budget"
    plan = AsyncEngine.plan_memory(path, enable_chunked_prefill=False, max_num_batched_tokens=128, max_model_len=128)
    assert plan.max_model_len == 128
