"""A scheduler plugin's own ``BaseException`` subclass, or ``asyncio.CancelledError``, raised as its module is
imported or from a hook the lab calls, is the plugin's fault: a one-line typed error naming it, as an ``Exception``
is. They went through the registry's import, the lab and the CLI bare: a traceback. ``SystemExit`` and
``KeyboardInterrupt`` keep their meaning."""

from __future__ import annotations

import pytest

from asyncinfer import cli
from asyncinfer.errors import InvalidParameterError
from asyncinfer.schedulers.registry import resolve_scheduler

RAISES = {
    "own": "class Stop(BaseException):\n    pass\n\n\nraise Stop('at import')\n",
    "cancel": "import asyncio\n\nraise asyncio.CancelledError()\n",
}
SHOWN = {"own": "Stop: at import", "cancel": "CancelledError"}


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("kind", sorted(RAISES))
def test_a_plugin_module_raising_a_base_exception_at_import_is_a_one_line_error_naming_it(
    kind, tmp_path, monkeypatch, capsys
) -> None:
    module = f"plugin_import_{kind}"
    (tmp_path / f"{module}.py").write_text(RAISES[kind])
    monkeypatch.syspath_prepend(str(tmp_path))
    capsys.readouterr()
    assert cli.main(["lab", "--synthetic", "3", "--plugin", module]) == 2
    assert one_line_error(capsys) == (f"asyncinfer: error: --plugin {module!r} is invalid: allowed an importable "
                                      f"module (importing it raised {SHOWN[kind]})\n")
    with pytest.raises(InvalidParameterError, match=rf"importing '{module}' raised {SHOWN[kind]}\)") as err:
        resolve_scheduler(f"{module}:Policy")
    assert err.value.parameter == "scheduler"


def test_a_plugin_module_exiting_at_import_still_exits(tmp_path, monkeypatch) -> None:
    (tmp_path / "plugin_import_exit.py").write_text("import sys\n\nsys.exit(4)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SystemExit) as exited:
        cli.main(["lab", "--synthetic", "3", "--plugin", "plugin_import_exit"])
    assert exited.value.code == 4


HOOKS = (
    "import asyncio\n"
    "from asyncinfer.schedulers import FIFOScheduler\n\n\n"
    "class Stop(BaseException):\n    pass\n\n\n"
    "class InSchedule(FIFOScheduler):\n    api_version = 1\n\n"
    "    def schedule(self):\n        raise Stop('in schedule')\n\n\n"
    "class InAdd(FIFOScheduler):\n    api_version = 1\n\n"
    "    def add_request(self, request):\n        raise asyncio.CancelledError()\n\n\n"
    "class InConstructor(FIFOScheduler):\n    api_version = 1\n\n"
    "    def __init__(self, config, kv):\n        super().__init__(config, kv)\n        raise Stop('built')\n"
)


@pytest.mark.parametrize(("name", "said"), [
    ("InSchedule", "at step 0 (0.000s): schedule() raised Stop: in schedule"),
    ("InAdd", "at step 0 (0.000s): add_request('r0') raised CancelledError"),
    ("InConstructor", "at construction: its constructor raised Stop: built with options {}"),
])
def test_a_plugin_hook_raising_a_base_exception_in_the_lab_is_its_broken_contract(
    name, said, tmp_path, monkeypatch, capsys
) -> None:
    (tmp_path / "plugin_hooks_base.py").write_text(HOOKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    capsys.readouterr()
    assert cli.main(["lab", "--synthetic", "3", "--schedulers", f"plugin_hooks_base:{name}"]) == 2
    err = one_line_error(capsys)
    assert err.startswith(f"asyncinfer: error: scheduler {name} broke the scheduler contract (docs/schedulers.md): "
                          f"{said}"), err
