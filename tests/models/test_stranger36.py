"""A stranger's first hour (stranger36): a model file of one's own, named as a relative path that is not there.

``asyncinfer chat -m models/llama.gguf`` (a typo, or run from another directory) and ``models/llama`` for
``models/llama.gguf`` are shaped as Hugging Face Hub ids (``OWNER/NAME``), so they were looked up in the local Hub
cache and refused with ``fetch it once with `huggingface-cli download models/llama.gguf``` : a command that cannot
fetch a file of one's own, and no ``did you mean 'models/llama.gguf'?``, which the same name without its directory
gets. Such a name that reads as a path here (a ``.gguf`` name, a first part that is a directory here, a ``.gguf`` file
beside it) is refused as a missing path now; a Hub id that reads as none is still refused with the command.
"""

from __future__ import annotations

import pytest

from asyncinfer import model_source
from asyncinfer.errors import ModelLoadError


@pytest.fixture
def here(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "llama.gguf").write_bytes(b"GGUF")
    return tmp_path


def refusal(model: str) -> str:
    with pytest.raises(ModelLoadError) as caught:
        model_source.resolve_model(model)
    return str(caught.value)


@pytest.mark.parametrize("model", ["models/llama", "models/llama.GGUF", "models/Llama"])
def test_a_relative_path_beside_its_gguf_file_is_pointed_at_it(here, model) -> None:
    message = refusal(model)
    if model == "models/Llama":  # another file's name: no guess, but a path, not a Hub id
        assert message.startswith("model path 'models/Llama' does not exist") and "huggingface-cli" not in message
    else:
        assert message == f"model path {model!r} does not exist (did you mean 'models/llama.gguf'?)"


@pytest.mark.parametrize("model", ["models/lama.gguf", "models/mistral", "elsewhere/llama.gguf"])
def test_a_missing_relative_path_is_refused_as_a_path_not_a_hub_id(here, model) -> None:
    message = refusal(model)
    assert message.startswith(f"model path {model!r} does not exist (nor is {model!r} a Hugging Face Hub id in the "
                              f"local cache, {here / 'hub'}; ")
    assert "huggingface-cli download" not in message


def test_a_hub_id_that_reads_as_no_path_still_says_how_to_fetch_it(here) -> None:
    message = refusal("HuggingFaceTB/SmolLM2-360M-Instruct")
    assert "fetch it once with `huggingface-cli download HuggingFaceTB/SmolLM2-360M-Instruct`" in message


def test_a_hub_id_in_the_cache_loads_though_its_owner_is_a_directory_here(here) -> None:
    snapshot = here / "hub" / "models--models--tiny" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    assert model_source.resolve_model("models/tiny") == snapshot
