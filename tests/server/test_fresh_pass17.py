"""A seventeenth adversarial pass over the HTTP server: each finding held to its fix."""

from __future__ import annotations

import pytest

from asyncinfer import cli
from asyncinfer.errors import InvalidParameterError
from asyncinfer.server import ServerSettings, Tenant

SPACED = "<a key with spaces around it>"
ALLOWED = "keys without leading or trailing spaces"


@pytest.mark.parametrize("key", ["sk-acme ", " sk-acme", "sk-acme\t", "\nsk-acme"])
def test_a_tenants_key_with_spaces_around_it_is_refused_as_api_keys_are(key) -> None:
    """``api_keys=(" k",)`` was refused, but ``tenants={" k": Tenant(...)}`` was accepted: the bearer check strips
    the token it reads, so that key could never match and the tenant's every call was a 401, silently. The
    refusal never shows the key (a secret)."""
    with pytest.raises(InvalidParameterError) as info:
        ServerSettings(tenants={"sk-vip": Tenant("vip"), key: Tenant("acme")})
    assert (info.value.parameter, info.value.value, info.value.allowed) == ("tenants", SPACED, ALLOWED)
    assert key.strip() not in str(info.value)
    with pytest.raises(InvalidParameterError) as plain:  # the same words as for api_keys
        ServerSettings(api_keys=(key,))
    assert (plain.value.value, plain.value.allowed) == (SPACED, ALLOWED)


def test_a_key_with_spaces_inside_is_still_a_key() -> None:
    settings = ServerSettings(tenants={"sk a": Tenant("acme")})
    assert settings.accepted_keys == ("sk a",)


def test_serve_refuses_a_tenant_flag_whose_key_has_spaces_around_it(capsys, monkeypatch) -> None:
    """``asyncinfer serve --tenant "sk-acme =acme"`` served with a key nobody could give; it exits 2 before
    loading anything, naming --tenant and not the key."""
    import asyncinfer.server

    def no_load(*args, **kwargs):
        raise AssertionError("served")

    monkeypatch.setattr(asyncinfer.server, "run_server", no_load)
    monkeypatch.delenv("ASYNCINFER_API_KEY", raising=False)
    assert cli.main(["serve", "--port", "0", "--tenant", "sk-acme =acme"]) == 2
    err = capsys.readouterr().err
    assert err == f"asyncinfer: error: --tenant '{SPACED}' is invalid: allowed {ALLOWED}\n"
