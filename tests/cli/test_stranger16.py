"""A sixteenth stranger's first hour: a scheduler plugin of one's own (docs/schedulers.md, "Writing one"),
each rough edge held to its fix."""

from __future__ import annotations

from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from asyncinfer import InvalidParameterError, cli
from asyncinfer.schedulers import registry, resolve_scheduler


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.rstrip("\n")


@pytest.fixture
def plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Two plugin modules that fail as they are imported: one whose top level raises, one that does not parse."""
    (tmp_path / "s16_raises.py").write_text('raise RuntimeError("no GPU here")\n')
    (tmp_path / "s16_typo.py").write_text("def schedule(:\n")
    (tmp_path / "s16_faulty.py").write_text(
        "from asyncinfer.schedulers import FIFOScheduler, SchedulerOutput\n\n\n"
        "class Raises(FIFOScheduler):\n"
        "    api_version = 1\n\n"
        "    def schedule(self) -> SchedulerOutput:\n"
        "        raise KeyError('budget')\n\n\n"
        "class Strict(FIFOScheduler):\n"
        "    api_version = 1\n\n"
        "    def __init__(self, config, kv, budget=4):\n"
        "        super().__init__(config, kv)\n"
        "        if budget < 1:\n"
        "            raise ValueError('budget must be positive')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


CASES = [
    (":Policy", "an importable 'module:Class' (an absolute module and a class)"),
    (".policies:Policy", "an importable 'module:Class' (an absolute module and a class)"),
    ("s16_raises:", "an importable 'module:Class' (an absolute module and a class)"),
    ("s16_raises:Policy", "an importable 'module:Class' (importing 's16_raises' raised RuntimeError: no GPU here)"),
    ("s16_typo:Policy", ("an importable 'module:Class' (importing 's16_typo' raised SyntaxError: invalid syntax "
                         "(s16_typo.py, line 1))")),
]


@pytest.mark.parametrize(("spec", "allowed"), CASES)
def test_a_plugin_that_fails_to_import_is_a_typed_refusal(plugins: Path, spec: str, allowed: str) -> None:
    """``scheduler=":Policy"`` raised ``ValueError: Empty module name``, ``".policies:Policy"`` a ``TypeError``, and
    a plugin module whose own code failed as it was imported its own exception: none an asyncinfer error, and
    the CLI called each an internal error of asyncinfer's. Each is the scheduler option's refusal, cause chained."""
    with pytest.raises(InvalidParameterError) as info:
        resolve_scheduler(spec)
    assert (info.value.parameter, info.value.value) == ("scheduler", spec)
    assert str(info.value) == f"scheduler={spec!r} is invalid: allowed {allowed}"
    if "raised" in allowed:
        assert info.value.__cause__ is not None


@pytest.mark.parametrize(("spec", "allowed"), CASES)
def test_the_cli_names_the_flag_not_an_internal_error(tiny_models, plugins: Path, capsys, spec: str,
                                                      allowed: str) -> None:
    path = str(tiny_models["llama"][0])
    assert cli.main(["info", path, "--scheduler", spec]) == 2
    assert _error_line(capsys) == f"asyncinfer: error: --scheduler {spec!r} is invalid: allowed {allowed}"


@pytest.mark.parametrize(("module", "allowed"), [
    ("s16_raises", "an importable module (importing it raised RuntimeError: no GPU here)"),
    ("s16_typo", "an importable module (importing it raised SyntaxError: invalid syntax (s16_typo.py, line 1))"),
    ("", "an importable module (an absolute module name)"),
    (".policies", "an importable module (an absolute module name)"),
])
def test_lab_plugin_that_fails_to_import_names_the_flag(plugins: Path, capsys, module: str, allowed: str) -> None:
    """``asyncinfer lab --plugin M``: a module that raised as it was imported, or an empty or relative name,
    was ``asyncinfer: internal error: ...`` with status 1; it is the flag's refusal, status 2."""
    assert cli.main(["lab", "--plugin", module, "--list-schedulers"]) == 2
    assert _error_line(capsys) == f"asyncinfer: error: --plugin {module!r} is invalid: allowed {allowed}"


def test_an_entry_point_that_fails_to_import_is_a_typed_refusal(plugins: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """An installed package's entry point whose module raises as it loads: the scheduler option's refusal."""
    broken = EntryPoint(name="s16-broken", value="s16_raises:Policy", group=registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry, "entry_points", lambda group: [broken] if group == registry.ENTRY_POINT_GROUP else [])
    with pytest.raises(InvalidParameterError) as info:
        resolve_scheduler("s16-broken")
    assert str(info.value) == ("scheduler='s16-broken' is invalid: allowed an entry point that imports "
                               "('s16_raises:Policy' raised RuntimeError: no GPU here)")
    assert isinstance(info.value.__cause__, RuntimeError)


def test_lab_names_a_schedule_that_raises_as_the_plugin_s_fault(plugins: Path, capsys) -> None:
    """``asyncinfer lab --schedulers mymod:Raises``: a ``schedule()`` that raised was ``asyncinfer: internal error:
    KeyError: 'budget'`` (status 1), while one that schedules nothing is the plugin's broken contract (status 2,
    docs/schedulers.md, "Progress"). Both are the plugin's now."""
    assert cli.main(["lab", "--schedulers", "s16_faulty:Raises", "--synthetic", "5"]) == 2
    assert _error_line(capsys) == ("asyncinfer: error: scheduler Raises broke the scheduler contract "
                                   "(docs/schedulers.md): at step 0 (0.000s): schedule() raised KeyError: 'budget'")


def test_simulate_raises_contract_violation_with_the_cause(plugins: Path) -> None:
    from asyncinfer.lab import ContractViolation, simulate, synthetic_trace

    with pytest.raises(ContractViolation, match=r"^Raises at step 0 \(0\.000s\): schedule\(\) raised KeyError: "
                                                r"'budget'$") as info:
        simulate(synthetic_trace(3, seed=0), "s16_faulty:Raises")
    assert isinstance(info.value.__cause__, KeyError)


@pytest.mark.parametrize(("option", "schedulers"), [
    ("pd_split.prefill_budget=64", "fifo, length-bucket, aging-priority, pd-split"),  # a typo of pd-split
    ("pd-split.prefill_budget=64", "fifo"),  # a policy left out of --schedulers
])
def test_lab_refuses_an_option_for_no_policy_it_runs(capsys, option: str, schedulers: str) -> None:
    """``asyncinfer lab --option pd_split.prefill_budget=64`` ran every policy with its defaults and printed the
    table as if the option had applied: an option whose NAME is none of the policies run is refused."""
    argv = ["lab", "--synthetic", "5", "--option", option]
    if schedulers == "fifo":
        argv += ["--schedulers", "fifo"]
    assert cli.main(argv) == 2
    assert _error_line(capsys) == (f"asyncinfer: error: --option {option!r} is invalid: allowed NAME one of the "
                                   f"schedulers run: {schedulers}")


def test_lab_names_a_constructor_that_refuses_with_its_own_error(plugins: Path, capsys) -> None:
    """A plugin's constructor that refuses an option with a ``ValueError`` (not the contract's
    ``InvalidParameterError``) was ``asyncinfer: internal error: ValueError: ...``; it is the plugin's fault."""
    assert cli.main(["lab", "--schedulers", "s16_faulty:Strict", "--option", "s16_faulty:Strict.budget=0",
                     "--synthetic", "5"]) == 2
    assert _error_line(capsys) == (
        "asyncinfer: error: scheduler Strict broke the scheduler contract (docs/schedulers.md): at construction: its "
        "constructor raised ValueError: budget must be positive with options {'budget': 0} (a bad option is an "
        "InvalidParameterError naming it)")


def test_lab_names_the_trace_request_whose_prompt_is_too_long(tmp_path: Path, capsys) -> None:
    """It was ``--trace 'r1' is invalid: allowed prompts shorter than max_model_len=4096``: the request's id read as
    the flag's value, and nothing said how long the prompt was or which flag sets the limit."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"id": "ok", "arrival": 0, "prompt_len": 10, "output_len": 4}\n'
                     '{"id": "r1", "arrival": 1, "prompt_len": 5000, "output_len": 4}\n')
    assert cli.main(["lab", "--trace", str(trace), "--schedulers", "fifo"]) == 2
    assert _error_line(capsys) == (
        f"asyncinfer: error: --trace {trace}: request 'r1' is invalid: allowed prompts shorter than "
        "max_model_len=4096 (request 'r1' has prompt_len=5000) (--max-model-len sets the limit)")
    assert cli.main(["lab", "--trace", str(trace), "--schedulers", "fifo", "--max-model-len", "8192",
                     "--num-blocks", "1024"]) == 0
    # a malformed line still reads as the file's line, and duplicate ids as the file
    trace.write_text('{"id": "a", "arrival": 0, "prompt_len": 10, "output_len": 4}\n' * 2)
    assert cli.main(["lab", "--trace", str(trace), "--schedulers", "fifo"]) == 2
    assert _error_line(capsys) == f"asyncinfer: error: --trace {str(trace)!r} is invalid: allowed unique request ids"
