"""A repeatable ``KEY=VALUE`` flag (``--scheduler-option``, ``serve --embedding-option``) takes each KEY once: a KEY
given twice is refused by the flag, naming it (the pairs became a dict that kept the last value silently, so
``--scheduler-option prefill_budget=0 --scheduler-option prefill_budget=64`` ran with 64 and never checked the 0)."""

from __future__ import annotations

from typing import Any

import pytest

import asyncinfer.server
from asyncinfer import cli


@pytest.mark.parametrize("command", ["info", "bench", "serve"])
def test_a_scheduler_option_given_twice_is_refused(tiny_models, capsys, monkeypatch, command) -> None:
    monkeypatch.setattr(asyncinfer.server, "run_server", lambda *args, **kwargs: None)  # never serves
    extra = ["--port", "0"] if command == "serve" else []
    with pytest.raises(SystemExit) as exc:
        cli.main([command, str(tiny_models["llama"][0]), *extra, "--scheduler", "pd-split",
                  "--scheduler-option", "prefill_budget=0", "--scheduler-option", "prefill_budget=64"])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.endswith("asyncinfer: error: argument --scheduler-option: prefill_budget is given twice: give each "
                        "KEY once\n"), err


def test_an_embedding_option_given_twice_is_refused(tiny_models, minilm_dir, capsys, monkeypatch) -> None:
    monkeypatch.setattr(asyncinfer.server, "run_server", lambda *args, **kwargs: None)  # never serves
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", str(tiny_models["llama"][0]), "--port", "0", "--embedding-model", str(minilm_dir),
                  "--embedding-option", "max_batch_size=0", "--embedding-option", "max_wait_ms=1",
                  "--embedding-option", "max_batch_size=8"])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.endswith("asyncinfer: error: argument --embedding-option: max_batch_size is given twice: give each "
                        "KEY once\n"), err


def test_distinct_keys_still_reach_the_engine_and_the_encoder(tiny_models, minilm_dir, monkeypatch) -> None:
    made: list[Any] = []
    real = asyncinfer.server.create_app
    monkeypatch.setattr(asyncinfer.server, "create_app", lambda specs, settings: made.append(specs) or real(specs, settings))
    monkeypatch.setattr(asyncinfer.server, "run_server", lambda *args, **kwargs: None)
    assert cli.main(["serve", str(tiny_models["llama"][0]), "--port", "0", "--scheduler", "pd-split",
                     "--scheduler-option", "prefill_budget=32", "--embedding-model", str(minilm_dir),
                     "--embedding-option", "max_busy_share=0.5", "--embedding-option", "max_batch_size=8"]) == 0
    [specs] = made
    assert specs[0].options["scheduler_options"] == {"prefill_budget": 32}
    assert dict(specs[1].options) == {"max_busy_share": 0.5, "max_batch_size": 8}
