"""A newcomer's first hour (stranger 27) with ``asyncinfer serve``'s tenants (docs/serving.md, "Who may get in").

- A header name that no request can carry (``--tenant-header "X-Tenant-Id:"``, as a curl ``-H`` line writes it, or one
  with a space or a letter of another alphabet) was accepted: every request then read as having no tenant or
  priority, and ``--cache-isolation header`` put every caller in one shared namespace, silently. Such a
  ``tenant_header`` or ``priority_header`` is refused at start now (``InvalidParameterError``; serve: status 2).
- One key given two tenants (``--tenant sk-a=acme --tenant sk-a=globex``, a key pasted twice) was served as the last
  one, silently: one tenant's callers ran as the other. ``asyncinfer serve`` refuses it, naming the tenants, never
  the key.
- An API key (``--api-key``, ``ASYNCINFER_API_KEY``, ``--tenant``, ``--metrics-key``) holding a character that is not
  printable ASCII (``sk\u2011abc``, a non-breaking hyphen pasted from a page) was accepted, but no client can present
  it (the openai package refuses a non-ASCII header; curl's UTF-8 bytes are read as Latin-1): every call was a 401
  "Incorrect API key provided". It is refused at start, never shown.
"""

from __future__ import annotations

import pytest

from asyncinfer import InvalidParameterError, cli
from asyncinfer.server import ServerSettings


@pytest.mark.parametrize("header", ["X-Tenant-Id:", "X Tenant", "x-ténant", "x-tenant\n-id", "x-tenant-id: acme"])
def test_a_header_name_no_request_can_carry_is_refused(header) -> None:
    for field in ("tenant_header", "priority_header"):
        with pytest.raises(InvalidParameterError) as err:
            ServerSettings(**{field: header})
        assert err.value.parameter == field and "header name" in err.value.allowed


def test_usual_header_names_are_kept_lowercased() -> None:
    settings = ServerSettings(tenant_from="header", tenant_header=" X-Team ", priority_header="X_Priority.v2")
    assert (settings.tenant_header, settings.priority_header) == ("x-team", "x_priority.v2")


def test_serve_refuses_a_bad_header_name_before_anything_loads(capsys) -> None:
    assert cli.main(["serve", "/no/such/model", "--tenant-from", "header", "--tenant-header", "X-Tenant-Id:"]) == 2
    err = capsys.readouterr().err
    assert "--tenant-header 'X-Tenant-Id:' is invalid" in err and "does not exist" not in err


def test_serve_refuses_one_key_given_two_tenants(capsys) -> None:
    argv = ["serve", "/no/such/model", "--tenant", "sk-secret=acme", "--tenant", "sk-secret=globex:-5"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "--tenant gives one key two tenants, acme:0 and globex:-5" in err
    assert "sk-secret" not in err and "does not exist" not in err  # never the key; before the model is looked at


def test_serve_takes_the_same_tenant_twice_and_distinct_keys() -> None:
    assert cli._tenants([("sk-a", _tenant("acme")), ("sk-a", _tenant("acme")), ("sk-b", _tenant("acme"))]) == {
        "sk-a": _tenant("acme"), "sk-b": _tenant("acme")}


def _tenant(name: str):
    from asyncinfer.server import Tenant

    return Tenant(name)


@pytest.mark.parametrize("key", ["sk\u2011abc", "sk-caf\u00e9", "sk\nx", "sk\tx"])
def test_a_key_no_client_can_send_is_refused_and_never_shown(key) -> None:
    from asyncinfer.server import Tenant

    for field, value in (("api_keys", (key,)), ("metrics_keys", (key,)), ("tenants", {key: Tenant("acme")})):
        with pytest.raises(InvalidParameterError) as err:
            ServerSettings(**{field: value})
        assert err.value.parameter == field and "printable ASCII" in err.value.allowed and key not in str(err.value)


def test_serve_refuses_such_a_key_variable_before_anything_loads(monkeypatch, capsys) -> None:
    monkeypatch.setenv("ASYNCINFER_API_KEY", "sk\u2011abc")
    assert cli.main(["serve", "/no/such/model"]) == 2
    err = capsys.readouterr().err
    assert "printable ASCII" in err and "sk\u2011abc" not in err and "does not exist" not in err
