"""A newcomer's first hour (stranger 45) with ``asyncinfer serve``'s keys (docs/serving.md, "Who may get in").

- A key in ``ASYNCINFER_API_KEY`` or ``ASYNCINFER_METRICS_KEY`` holding a character that is not printable ASCII
  (a non-breaking hyphen pasted from a page) was refused as if a flag had given it: ``asyncinfer serve`` said
  ``--api-key '<a key ...>' is invalid`` (``--metrics-key``) to someone who passed no such flag, and
  examples/openai_server.py said ``api_keys=...``. The variable is named now, as for its other refusals.
- A metrics key that is also an API key, both given by the variables, was refused as ``--metrics-key ...``; the
  message names ``ASYNCINFER_METRICS_KEY`` where no ``--metrics-key`` was given.
"""

from __future__ import annotations

import pytest

from asyncinfer import InvalidParameterError, cli
from asyncinfer.server import api_keys_from_env, metrics_keys_from_env


@pytest.mark.parametrize(("variable", "read"), [("ASYNCINFER_API_KEY", api_keys_from_env),
                                                ("ASYNCINFER_METRICS_KEY", metrics_keys_from_env)])
@pytest.mark.parametrize("raw", ["sk\u2011abc", "sk-ok, sk-caf\u00e9"])
def test_a_variables_key_no_client_can_send_is_refused_naming_the_variable(variable, read, raw) -> None:
    with pytest.raises(InvalidParameterError) as err:
        read({variable: raw})
    assert err.value.parameter == variable and "printable ASCII" in err.value.allowed
    assert "abc" not in str(err.value) and "caf" not in str(err.value)  # never the key


def test_a_variables_printable_keys_are_read() -> None:
    assert api_keys_from_env({"ASYNCINFER_API_KEY": "sk-a, sk-b"}) == ("sk-a", "sk-b")


@pytest.mark.parametrize("variable", ["ASYNCINFER_API_KEY", "ASYNCINFER_METRICS_KEY"])
def test_serve_names_the_variable_not_a_flag_never_given(monkeypatch, capsys, variable) -> None:
    monkeypatch.delenv("ASYNCINFER_API_KEY", raising=False)
    monkeypatch.delenv("ASYNCINFER_METRICS_KEY", raising=False)
    monkeypatch.setenv(variable, "sk\u2011abc")
    assert cli.main(["serve", "/no/such/model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"asyncinfer: error: {variable}='<a key with a character that is not printable ASCII>' "
                          "is invalid: allowed keys of printable ASCII characters"), err
    assert "--api-key" not in err and "--metrics-key" not in err and "sk\u2011abc" not in err


def test_serve_names_the_metrics_variable_for_a_metrics_key_also_an_api_key(monkeypatch, capsys) -> None:
    monkeypatch.setenv("ASYNCINFER_API_KEY", "sk-shared")
    monkeypatch.setenv("ASYNCINFER_METRICS_KEY", "sk-shared")
    assert cli.main(["serve", "/no/such/model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("asyncinfer: error: ASYNCINFER_METRICS_KEY='<a key also in --api-key / --tenant (or "
                          "ASYNCINFER_API_KEY)>' is invalid"), err
    assert "--metrics-key" not in err and "sk-shared" not in err


def test_serve_names_the_flag_for_a_metrics_key_given_by_it(monkeypatch, capsys) -> None:
    monkeypatch.delenv("ASYNCINFER_METRICS_KEY", raising=False)
    monkeypatch.setenv("ASYNCINFER_API_KEY", "sk-shared")
    assert cli.main(["serve", "/no/such/model", "--metrics-key", "sk-shared"]) == 2
    assert capsys.readouterr().err.startswith("asyncinfer: error: --metrics-key '<a key also in --api-key")
