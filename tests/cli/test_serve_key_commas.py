"""``asyncinfer serve --api-key "sk-x,,sk-y"`` started with one key, the literal text with its commas ("API keys: on
(1 accepted)"; sk-x and sk-y each got a 401), where ASYNCINFER_API_KEY="sk-x,,sk-y" is split on the commas and
refused at start. A key given to the flag holds no comma: refused before anything loads, naming the flag, the key
unshown."""

from __future__ import annotations

import pytest

from asyncinfer import cli


@pytest.mark.parametrize(("flag", "variable", "value"), [
    ("--api-key", "ASYNCINFER_API_KEY", "sk-x,,sk-y"),
    ("--api-key", "ASYNCINFER_API_KEY", "sk-x,sk-y"),
    ("--metrics-key", "ASYNCINFER_METRICS_KEY", "m1,"),
])
def test_a_key_flag_with_a_comma_is_refused_before_the_load(no_load, capsys, monkeypatch, flag, variable, value) -> None:
    monkeypatch.delenv("ASYNCINFER_API_KEY", raising=False)
    monkeypatch.delenv("ASYNCINFER_METRICS_KEY", raising=False)
    extra = ["--api-key", "sk-ok"] if flag == "--metrics-key" else []
    assert cli.main(["serve", "--port", "0", *extra, flag, value]) == 2
    err = capsys.readouterr().err
    assert err == (f"asyncinfer: error: {flag} '<a key with a comma>' is invalid: allowed one key per {flag} without "
                   f"commas: repeat {flag} for each key ({variable} takes them comma-separated)\n")
    assert value not in err  # a key is never shown
