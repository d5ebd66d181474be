"""A GGUF file's tokenizer is built once, cached as tokenizer.json, and the cached one behaves identically."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from asyncinfer import model_source
from asyncinfer.models import loader, tokenizer_build
from asyncinfer.models.loader import gguf_tokenizer
from asyncinfer.models.tokenizer import CachedTokenizer

TEXTS = [
    "What is the capital of France?",
    "  leading spaces, tabs\tand\nnewlines  ",
    "Émoji 🤖🎉 and 中文字符 and ünïcödé",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "",
]


@pytest.mark.real_model
def test_the_cached_tokenizer_equals_the_one_built_from_the_gguf(real_gguf, real_hf_reference) -> None:
    built = real_hf_reference[1]  # transformers' own, from the GGUF metadata
    cached = gguf_tokenizer(real_gguf)  # the user cache's copy (built once by an earlier load)
    assert isinstance(cached, CachedTokenizer)  # loaded without transformers (tests/models/test_tokenizer.py)
    assert cached.get_vocab() == built.get_vocab() and len(cached) == len(built)
    assert cached.all_special_tokens == built.all_special_tokens
    assert (cached.eos_token_id, cached.bos_token_id, cached.pad_token_id) == (
        built.eos_token_id, built.bos_token_id, built.pad_token_id)
    assert cached.chat_template == built.chat_template
    for text in TEXTS:
        ids = built.encode(text)
        assert cached.encode(text) == ids, text
        assert cached.encode(text, add_special_tokens=False) == built.encode(text, add_special_tokens=False)
        for skip in (True, False):
            assert cached.decode(ids, skip_special_tokens=skip) == built.decode(ids, skip_special_tokens=skip)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[2]}]
    assert cached.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
        built.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_the_cache_lives_next_to_the_default_model_and_elsewhere_never_beside_a_users_file(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCINFER_CACHE_DIR", str(tmp_path / "cache"))
    default = tmp_path / "cache" / "smollm2-135m-instruct" / "model.gguf"
    assert model_source.tokenizer_cache_dir(default) == default.with_name("model.tokenizer")
    user = tmp_path / "models" / "mine.gguf"
    where = model_source.tokenizer_cache_dir(user)
    assert where.parent == (tmp_path / "cache" / "tokenizers").resolve() and where.name.startswith("mine-")
    assert model_source.tokenizer_cache_dir(tmp_path / "other" / "mine.gguf") != where  # keyed by the path


class _Header:
    """Stands for a parsed GGUF header (these files are no GGUF): its digest is the file's bytes'."""

    def __init__(self, path: Path) -> None:
        self.data = Path(path).read_bytes()

    def header_digest(self) -> str:
        return self.data.hex()


@pytest.fixture
def fake_headers(monkeypatch) -> None:
    monkeypatch.setattr(loader, "GGUFFile", _Header)


class _Built:
    """Stands for a transformers tokenizer: save_pretrained writes a file, from_pretrained reads it back."""

    def __init__(self, word: str) -> None:
        self.word = word

    def save_pretrained(self, path: Path) -> None:
        (Path(path) / "tokenizer.json").write_text(json.dumps({"word": self.word}))

    @classmethod
    def from_pretrained(cls, path: Path) -> _Built:
        return cls(json.loads((Path(path) / "tokenizer.json").read_text())["word"])


def _bounded_builds(monkeypatch, builds: list[Path]) -> None:
    """The bounded build (a separate process, :mod:`asyncinfer.models.tokenizer_build`) stood for in this one: it
    counts the builds and saves a :class:`_Built` where it is asked to; a build in this process fails the test."""
    import transformers

    def never(*args, **kwargs):
        raise AssertionError("built in the serving process, though the bounded build saved the tokenizer")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", never)

    def check_build(source, *, vocab_size, gguf_file=None, save_to=None, bounds=None):
        builds.append(Path(source) / gguf_file)
        if save_to is not None:
            _Built(f"build {len(builds)}").save_pretrained(save_to)
        return tokenizer_build.BuildReport(tokens=1, tokenizer_class=f"{_Built.__module__}.{_Built.__qualname__}")

    monkeypatch.setattr(tokenizer_build, "check_build", check_build)


def test_built_once_reused_and_rebuilt_when_the_file_changes(tmp_path, monkeypatch, fake_headers) -> None:
    monkeypatch.setenv("ASYNCINFER_CACHE_DIR", str(tmp_path / "cache"))
    gguf_path = tmp_path / "cache" / "m" / "m.gguf"
    gguf_path.parent.mkdir(parents=True)
    gguf_path.write_bytes(b"first")
    builds: list[Path] = []
    _bounded_builds(monkeypatch, builds)
    assert gguf_tokenizer(gguf_path).word == "build 1"
    cache = gguf_path.with_name("m.tokenizer")
    stamp = json.loads((cache / "asyncinfer-tokenizer.json").read_text())
    assert stamp["class"].endswith("_Built") and stamp["size"] == 5
    assert gguf_tokenizer(gguf_path).word == "build 1" and len(builds) == 1  # from the cache
    gguf_path.write_bytes(b"second, longer")  # another file at the same path
    os.utime(gguf_path, ns=(1, 1))
    assert gguf_tokenizer(gguf_path).word == "build 2" and len(builds) == 2
    assert not [p for p in cache.parent.iterdir() if p.name.startswith(".tokenizer-")]  # no staging left behind


def test_a_cache_that_cannot_be_written_costs_only_the_rebuild(tmp_path, monkeypatch, caplog,
                                                               fake_headers) -> None:
    monkeypatch.setenv("ASYNCINFER_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache").write_text("a file where the cache directory should be")
    gguf_path = tmp_path / "m.gguf"
    gguf_path.write_bytes(b"x")
    builds: list[Path] = []
    _bounded_builds(monkeypatch, builds)
    # the bounded build saved it in a private directory, read back from there (and removed)
    assert gguf_tokenizer(gguf_path).word == "build 1"
    assert builds == [gguf_path]
    assert "could not cache the tokenizer" in caplog.text
    assert loader._cached_tokenizer(tmp_path / "nowhere", {}) is None


def test_the_cached_tokenizers_are_held_to_the_most_recently_used(tmp_path, monkeypatch) -> None:
    """One cache a GGUF file's path, never removed: 255 directories (117 MB) piled up here from temporary paths
    (pass93). Past KEPT_TOKENIZER_CACHES, the least recently used go."""
    from tests.models.test_tokenizer import write_tokenizer_gguf

    monkeypatch.setenv("ASYNCINFER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(loader, "KEPT_TOKENIZER_CACHES", 2)
    files = [write_tokenizer_gguf(tmp_path / f"m{i}.gguf", "{{ 'x' }}") for i in range(3)]
    caches = [model_source.tokenizer_cache_dir(file) for file in files]
    gguf_tokenizer(files[0])
    gguf_tokenizer(files[1])
    gguf_tokenizer(files[0])  # a cache hit: used last
    gguf_tokenizer(files[2])
    assert (caches[0].exists(), caches[1].exists(), caches[2].exists()) == (True, False, True)
    assert (tmp_path / "cache" / "tokenizers" / "verdicts").exists() is False  # (no directory's verdicts here)
