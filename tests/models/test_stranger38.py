"""A stranger's first hour (stranger38): a model file of one's own, its name typed in another case.

docs/api.md: "a missing path is a ``ModelLoadError`` (one that names a ``.gguf`` file beside it without its suffix,
or in another case, asks "did you mean 'my-model.gguf'?")". Only the suffix's case was looked at: GGUF files are
named in mixed case (``Llama-3.2-1B-Instruct-Q4_K_M.gguf``, ``SmolLM2-135M-Instruct.Q4_1.gguf``), and the name typed
in lower case (``asyncinfer chat -m llama-3.2-1b-instruct-q4_k_m.gguf``) was refused with the list of what a
model may be, as if nothing were there. The one ``.gguf`` file or directory beside it whose name differs only in
case is pointed at now, also where ``ASYNCINFER_MODEL`` names it.

And a Hugging Face directory of the older kind, ``config.json`` and ``pytorch_model.bin`` (PyTorch's pickle format,
which the loader never reads), was refused as ``no *.safetensors weights in DIR``, as if it held no weights at all:
the refusal names the pickle file now, says why it is not read and what to do.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncinfer import AsyncEngine, ModelLoadError, cli
from tests.helpers import tiny_hf_config

FILE = "Llama-3.2-1B-Instruct-Q4_K_M.gguf"


@pytest.fixture
def models_here(tmp_path: Path, monkeypatch) -> Path:
    """A working directory holding a mixed-case GGUF file (never read: every refusal comes first) and a model
    directory ``MyModel``."""
    (tmp_path / FILE).write_bytes(b"GGUF")
    (tmp_path / "MyModel").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize(("given", "near"), [
    ("llama-3.2-1b-instruct-q4_k_m.gguf", FILE),
    ("llama-3.2-1b-instruct-q4_k_m", FILE),
    ("LLAMA-3.2-1B-INSTRUCT-Q4_K_M.GGUF", FILE),
    ("mymodel", "MyModel"),
])
def test_a_name_in_another_case_is_pointed_at(models_here: Path, given: str, near: str) -> None:
    with pytest.raises(ModelLoadError) as err:
        AsyncEngine.from_pretrained(given, num_threads=1)
    assert str(err.value) == f"loading {given!r} failed: model path {given!r} does not exist (did you mean {near!r}?)"


@pytest.mark.parametrize("given", ["llama-3.2-1b-instruct-q4_k_m.gguf", "Llama-3.2-1B-Instruct-Q4_K_M"])
def test_asyncinfer_model_in_another_case_or_without_its_suffix_is_pointed_at(models_here: Path, monkeypatch,
                                                                              given: str) -> None:
    monkeypatch.setenv("ASYNCINFER_MODEL", given)
    with pytest.raises(ModelLoadError) as err:
        AsyncEngine.from_pretrained(num_threads=1)
    assert str(err.value).endswith(f"model path {given!r} does not exist (it is ASYNCINFER_MODEL's; did you mean "
                                   f"{FILE!r}? set that to a model path, or unset it for the default model, "
                                   "SmolLM2-135M-Instruct)")


def test_the_command_line_says_it_in_one_line(models_here: Path, capsys) -> None:
    assert cli.main(["info", "llama-3.2-1b-instruct-q4_k_m.gguf"]) == 2
    err = capsys.readouterr().err
    assert err == ("asyncinfer: error: model path 'llama-3.2-1b-instruct-q4_k_m.gguf' does not exist "
                   f"(did you mean {FILE!r}?)\n")


def test_two_names_in_other_cases_point_at_neither(models_here: Path) -> None:
    (models_here / "llama-3.2-1B-instruct-Q4_K_M.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError) as err:
        AsyncEngine.from_pretrained("LLAMA-3.2-1B-INSTRUCT-Q4_K_M.gguf", num_threads=1)
    assert "did you mean" not in str(err.value) and "expected a Hugging Face model directory" in str(err.value)


def test_a_plain_file_in_another_case_is_no_model_to_point_at(models_here: Path) -> None:
    (models_here / "Notes.txt").write_text("not a model")
    with pytest.raises(ModelLoadError) as err:
        AsyncEngine.from_pretrained("notes.txt", num_threads=1)
    assert "did you mean" not in str(err.value)


@pytest.mark.parametrize("names", [["pytorch_model.bin"], ["pytorch_model-00001-of-00002.bin",
                                                           "pytorch_model-00002-of-00002.bin"]])
def test_pickle_weights_are_named_in_the_refusal(tmp_path: Path, names: list[str]) -> None:
    tiny_hf_config("llama").save_pretrained(tmp_path)
    for name in names:
        (tmp_path / name).write_bytes(b"never read")
    with pytest.raises(ModelLoadError) as err:
        AsyncEngine.from_pretrained(tmp_path, num_threads=1)
    more = " and more" if len(names) > 1 else ""
    assert str(err.value) == (
        f"loading {str(tmp_path)!r} failed: no *.safetensors weights in {tmp_path} ({names[0]}{more}: PyTorch pickle "
        "weights, which asyncinfer does not read, since loading a pickle can run any code: save the model as "
        "safetensors once, as transformers' save_pretrained writes it)")


def test_a_training_run_s_files_are_no_weights_to_name(tmp_path: Path) -> None:
    tiny_hf_config("llama").save_pretrained(tmp_path)
    (tmp_path / "training_args.bin").write_bytes(b"never read")
    with pytest.raises(ModelLoadError) as err:
        AsyncEngine.from_pretrained(tmp_path, num_threads=1)
    assert str(err.value) == f"loading {str(tmp_path)!r} failed: no *.safetensors weights in {tmp_path}"
