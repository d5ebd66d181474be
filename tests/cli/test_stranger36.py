"""A stranger's first hour (stranger36): ``ASYNCINFER_MODEL`` and ``asyncinfer serve``.

The README says ``ASYNCINFER_MODEL=/path/to/model`` uses another model where none is given. ``asyncinfer serve``
loaded it, but served it as ``SmolLM2-135M-Instruct`` (its start line: ``model 'SmolLM2-135M-Instruct':
models/gemma3.gguf``), so a client asking for SmolLM2 by name got another model, and one asking for the file's
name (as ``asyncinfer serve models/gemma3.gguf`` serves it) a 404. The model is served after its file or directory
now, as a MODEL given on the command line is; the default model's own file keeps SmolLM2's name.
"""

from __future__ import annotations

import pytest

from asyncinfer.model_source import DEFAULT_GGUF_NAME
from asyncinfer.server import ModelSpec


@pytest.mark.parametrize(("env", "name"), [
    ("models/gemma3.gguf", "gemma3"),
    ("/srv/models/Qwen2.5-0.5B-Instruct/", "Qwen2.5-0.5B-Instruct"),
    (f"/root/.cache/asyncinfer/smollm2-135m-instruct/{DEFAULT_GGUF_NAME}", "SmolLM2-135M-Instruct"),
    ("", "SmolLM2-135M-Instruct"),
])
def test_the_default_model_is_served_under_the_name_of_the_model_asyncinfer_model_names(monkeypatch, tmp_path, env,
                                                                                       name) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "gemma3.gguf").write_bytes(b"GGUF")
    monkeypatch.setenv("ASYNCINFER_MODEL", env)
    assert ModelSpec.served_name(None) == name


def test_serve_names_the_model_it_loads_in_its_start_lines(monkeypatch, tmp_path, capsys) -> None:
    import asyncinfer.server
    from asyncinfer import cli
    from tests.models.test_gguf_loading import tiny_gguf

    model = tiny_gguf(tmp_path / "mine.gguf")
    monkeypatch.setattr(asyncinfer.server, "run_server", lambda *args, **kwargs: None)
    monkeypatch.setenv("ASYNCINFER_MODEL", str(model))
    assert cli.main(["serve", "--port", "0", "--threads", "1", "--max-model-len", "64"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == f"  model 'mine': {model}"
