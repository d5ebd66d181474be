"""A tokenizer is first built in a separate process bounded in memory and CPU time (asyncinfer.models.tokenizer_build):
what it costs past its bounds, or what it builds past the model's vocabulary, is refused before the serving process
builds anything."""

from __future__ import annotations

import json
import resource
from pathlib import Path

import pytest
import transformers
from tokenizers import Tokenizer, models

from asyncinfer.errors import ModelLoadError
from asyncinfer.models import tokenizer_build
from asyncinfer.models.checkpoint import load_hf_tokenizer
from asyncinfer.models.loader import gguf_tokenizer
from asyncinfer.models.tokenizer import CachedTokenizer
from asyncinfer.models.tokenizer_build import BuildBounds, build_bounds, check_build
from tests.models.test_tokenizer import write_tokenizer_gguf


def word_level(where: Path, words: int, added: int = 0) -> Path:
    """A fast tokenizer of ``words`` words and ``added`` added special tokens, as transformers saves one."""
    where.mkdir()
    vocab = {"<unk>": 0, **{f"w{i}": i + 1 for i in range(words)}}
    data = json.loads(Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).to_str())
    data["added_tokens"] = [{"id": len(vocab) + i, "content": f"<x{i}>", "single_word": False, "lstrip": False,
                             "rstrip": False, "normalized": False, "special": True} for i in range(added)]
    (where / "tokenizer.json").write_text(json.dumps(data))
    (where / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return where


def never_built_here(monkeypatch) -> None:
    """transformers' builds in this (the serving) process fail the test from now on: only the bounded build may
    run."""

    def refuse(*args, **kwargs):
        raise AssertionError("the tokenizer was built in the serving process")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)


@pytest.fixture(name="never_built_here")
def _never_built_here(monkeypatch) -> None:
    never_built_here(monkeypatch)


def test_a_build_within_its_bounds_reports_what_transformers_builds(tmp_path) -> None:
    path = word_level(tmp_path / "t", 40, added=3)
    report = check_build(path, vocab_size=44)
    built = transformers.AutoTokenizer.from_pretrained(path)
    assert report.tokens == len(built) == 44
    assert report.tokenizer_class == f"{type(built).__module__}.{type(built).__qualname__}"


def test_the_bounds_grow_with_the_models_vocabulary() -> None:
    small, gemma = build_bounds(49_152), build_bounds(262_144)
    assert small.memory_bytes == 1024 * 2**20 + 49_152 * 8 * 1024
    assert gemma.memory_bytes == 1024 * 2**20 + 262_144 * 8 * 1024
    assert (small.cpu_seconds, gemma.cpu_seconds) == (60 + 49.152, 60 + 262.144)
    assert small.wall_seconds == small.cpu_seconds * 3 + 30
    assert build_bounds(None) == gemma


def test_more_tokens_than_the_model_embeds_are_refused_before_this_process_builds_them(tmp_path,
                                                                                     never_built_here) -> None:
    """A slow tokenizer's vocab.txt may hold a few entries past the model's vocabulary (a header, specials): the
    checks before the build let 100 more through, and transformers built them in this process before they were
    refused. The bounded build counts them first."""
    vocab = 500
    path = tmp_path / "bert"
    path.mkdir()
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *(f"w{i}" for i in range(vocab + 95))]
    (path / "vocab.txt").write_text("\n".join(words) + "\n")
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer"}))
    with pytest.raises(ModelLoadError) as refused:
        load_hf_tokenizer(path, vocab)
    assert str(refused.value) == (f"the tokenizer of {path} has {vocab + 100} tokens (built in a separate process, "
                                  f"refused before this one builds it) but the model embeds only {vocab}")


def test_a_build_past_its_memory_is_stopped_and_the_next_one_builds(tmp_path) -> None:
    path = word_level(tmp_path / "t", 20_000)
    with pytest.raises(ModelLoadError, match=r"^building the tokenizer of .* took more than 1 MiB, the most a "
                                             r"tokenizer of a model of 20001 tokens may take \(built in a separate "
                                             r"process, which ran out of it"):
        check_build(path, vocab_size=20_001, bounds=BuildBounds(memory_bytes=2**20, cpu_seconds=60, wall_seconds=200))
    assert check_build(path, vocab_size=20_001).tokens == 20_001  # the helper goes on


def test_a_build_past_its_cpu_time_is_stopped(tmp_path) -> None:
    """300,000 added tokens take transformers seconds of CPU (each is a Python object): past one second, the build's
    process is stopped by its CPU limit."""
    path = word_level(tmp_path / "t", 10, added=300_000)
    before = resource.getrusage(resource.RUSAGE_SELF)
    with pytest.raises(ModelLoadError, match=r"^building the tokenizer of .* took more than 0.5 s of CPU, the most a "
                                             r"tokenizer of a model of 300011 tokens may take \(0.5 s of CPU, 60 s in "
                                             r"all; built in a separate process, which was stopped\)$"):
        check_build(path, vocab_size=300_011, bounds=BuildBounds(memory_bytes=2**30, cpu_seconds=0.5,
                                                                 wall_seconds=60))
    after = resource.getrusage(resource.RUSAGE_SELF)
    assert after.ru_utime - before.ru_utime < 0.5  # (json.dumps of the request: this process built nothing)


def test_a_build_past_its_wall_clock_time_is_stopped(tmp_path) -> None:
    path = word_level(tmp_path / "t", 10, added=300_000)
    with pytest.raises(ModelLoadError, match=r"^building the tokenizer of .* took more than 0.2 s, the most"):
        check_build(path, vocab_size=None, bounds=BuildBounds(memory_bytes=2**30, cpu_seconds=60, wall_seconds=0.2))


def test_transformers_refusal_is_passed_on_with_the_directorys_hint(tmp_path, never_built_here) -> None:
    path = tmp_path / "m"
    path.mkdir()
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    with pytest.raises(ModelLoadError, match=r"^cannot load the tokenizer in .*/m: it holds tokenizer_config.json but "
                                             r"no vocabulary \(tokenizer.json, tokenizer.model, vocab.json\): copy "
                                             r"the model's tokenizer files beside its config.json \(transformers: "):
        load_hf_tokenizer(path, 100)


def test_a_helper_that_ended_is_started_again(tmp_path) -> None:
    path = word_level(tmp_path / "t", 10)
    assert check_build(path, vocab_size=11).tokens == 11
    helper = tokenizer_build._HELPER._process
    assert helper is not None
    helper.kill()
    helper.wait()
    assert check_build(path, vocab_size=11).tokens == 11
    tokenizer_build.stop_helper()
    assert tokenizer_build._HELPER._process is None
    assert check_build(path, vocab_size=11).tokens == 11


def test_without_fork_each_build_has_a_helper_of_its_own(tmp_path, monkeypatch) -> None:
    """Where ``fork`` does not exist (Windows), the helper builds the one request within its limits, and ends."""
    tokenizer_build.stop_helper()
    monkeypatch.setattr(tokenizer_build, "_FORKS", False)
    path = word_level(tmp_path / "t", 20_000)
    assert check_build(path, vocab_size=20_001).tokens == 20_001
    assert tokenizer_build._HELPER._process is None
    with pytest.raises(ModelLoadError, match="took more than 1 MiB"):
        check_build(path, vocab_size=20_001, bounds=BuildBounds(memory_bytes=2**20, cpu_seconds=60, wall_seconds=200))


def test_a_gguf_tokenizer_is_built_and_cached_by_the_bounded_build(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ASYNCINFER_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tokenizer_gguf(tmp_path / "t.gguf", "{{ messages[0]['content'] }}")
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="t.gguf")
    never_built_here(monkeypatch)
    tokenizer = gguf_tokenizer(path, vocab_size=100)
    assert isinstance(tokenizer, CachedTokenizer)  # the cache the bounded build wrote, loaded without transformers
    for text in ("What is the capital of France?", " and Italy", "hi ok"):
        assert tokenizer.encode(text) == reference.encode(text)
    with pytest.raises(ModelLoadError, match=r"^the tokenizer of .*t2\.gguf has \d+ tokens \(built in a separate "
                                             r"process, refused before this one builds it\) but the model embeds "
                                             r"only 10$"):
        gguf_tokenizer(write_tokenizer_gguf(tmp_path / "t2.gguf", "x"), vocab_size=10)
    assert not [entry for entry in (tmp_path / "cache" / "tokenizers").iterdir() if entry.name.startswith(".")]


def test_the_helper_ends_with_the_process_that_started_it(tmp_path) -> None:
    """It reads its requests from this process: at that pipe's end (this process gone) it ends."""
    path = word_level(tmp_path / "t", 10)
    check_build(path, vocab_size=11)
    helper = tokenizer_build._HELPER._process
    assert helper is not None and helper.stdin is not None
    helper.stdin.close()  # as this process's end closes it
    assert helper.wait(30) == 0
    tokenizer_build.stop_helper()
