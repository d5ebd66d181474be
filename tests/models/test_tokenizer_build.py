"""A tokenizer is first built in a separate process bounded in memory and CPU time (asyncinfer.models.tokenizer_build):
what it costs past its bounds, or what it builds past the model's vocabulary, is refused before the serving process
builds anything."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
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
from tests.helpers import sigint_not_ignored
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
                                  f"refused before this one builds it) but the model embeds only {vocab}: is it "
                                  "another model's tokenizer? Copy this model's own tokenizer files beside its "
                                  "config.json")


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
                                             r"the model's tokenizer files beside its config.json$"):
        load_hf_tokenizer(path, 100)


def test_a_helper_that_ended_is_started_again(tmp_path) -> None:
    path = word_level(tmp_path / "t", 10)
    assert check_build(path, vocab_size=11).tokens == 11
    helpers = tokenizer_build._HELPERS.processes()
    assert len(helpers) == 1
    helpers[0].kill()
    helpers[0].wait()
    assert check_build(path, vocab_size=11).tokens == 11
    tokenizer_build.stop_helper()
    assert tokenizer_build._HELPERS.processes() == []
    assert check_build(path, vocab_size=11).tokens == 11


def test_without_fork_each_build_has_a_helper_of_its_own(tmp_path, monkeypatch) -> None:
    """Where ``fork`` does not exist (Windows), the helper builds the one request within its limits, and ends."""
    tokenizer_build.stop_helper()
    monkeypatch.setattr(tokenizer_build, "_FORKS", False)
    path = word_level(tmp_path / "t", 20_000)
    assert check_build(path, vocab_size=20_001).tokens == 20_001
    assert tokenizer_build._HELPERS.processes() == []
    with pytest.raises(ModelLoadError, match="took more than 1 MiB"):
        check_build(path, vocab_size=20_001, bounds=BuildBounds(memory_bytes=2**20, cpu_seconds=60, wall_seconds=200))


def test_a_long_build_holds_up_no_other_build(tmp_path) -> None:
    """Each build takes an idle helper or starts one: a tokenizer that takes its whole bounds (here 300,000 added
    tokens, seconds of CPU) never delays another model's (one build at a time held them all up to its limits)."""
    slow = word_level(tmp_path / "slow", 10, added=300_000)
    quick = word_level(tmp_path / "quick", 10)
    check_build(quick, vocab_size=11)  # a helper idle
    ended: dict[str, float] = {}

    def build(name: str, path: Path) -> None:
        with contextlib.suppress(ModelLoadError):
            check_build(path, vocab_size=None, bounds=BuildBounds(memory_bytes=2**31, cpu_seconds=30,
                                                                  wall_seconds=60))
        ended[name] = time.monotonic()

    long = threading.Thread(target=build, args=("slow", slow))
    long.start()
    time.sleep(0.5)  # the slow one has the idle helper
    build("quick", quick)
    assert "slow" not in ended  # the quick one, in a helper of its own, ended first
    tokenizer_build.stop_helper()  # the slow build ends with its helper
    long.join(30)
    assert not long.is_alive() and ended["slow"] > ended["quick"]


_INTERRUPTED = """
import sys, time, json
from pathlib import Path
from asyncinfer.models import tokenizer_build
tokenizer_build.prepare()
print(json.dumps([p.pid for p in tokenizer_build._HELPERS.processes()]), flush=True)
tokenizer_build.check_build(Path(sys.argv[1]), vocab_size=None)
"""


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "kill"])
def test_a_serving_process_that_ends_mid_build_takes_its_helper_and_build_with_it(tmp_path, how) -> None:
    """Ctrl-C (or a kill) during a build: the helper and the build it forked end too (the build ignored Ctrl-C and
    outlived its serving process, up to its CPU limit, writing the GGUF cache's staging directory after it was
    removed)."""
    slow = word_level(tmp_path / "slow", 10, added=600_000)
    root = Path(__file__).resolve().parents[2]
    with sigint_not_ignored():  # (started with & without job control, a suite has SIGINT ignored)
        serving = subprocess.Popen([sys.executable, "-c", _INTERRUPTED, str(slow)], stdout=subprocess.PIPE, text=True,
                                   env={**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)])})
    assert serving.stdout is not None
    (helper,) = json.loads(serving.stdout.readline())
    deadline = time.monotonic() + 60
    while len(_group(helper)) < 2:  # the build forked
        assert time.monotonic() < deadline and serving.poll() is None
        time.sleep(0.1)
    serving.send_signal(how)
    assert serving.wait(30) == -how  # ended by the signal, not by the build's end
    deadline = time.monotonic() + 15
    while _group(helper):
        assert time.monotonic() < deadline, f"left running: {_group(helper)}"
        time.sleep(0.1)


def _group(leader: int) -> list[int]:
    """The live processes of the process group ``leader`` leads (zombies left out)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == leader and fields[0] != "Z":
                    found.append(int(entry.name))
    return found


def test_a_verdict_is_kept_for_the_same_files(tmp_path, monkeypatch) -> None:
    """Files (byte for byte) built within their bounds before, for the same vocab_size, are not built again; another
    vocab_size, a byte changed or a file added that a tokenizer may be built from, are."""
    monkeypatch.setenv("ASYNCINFER_CACHE_DIR", str(tmp_path / "cache"))
    path = word_level(tmp_path / "t", 10)
    builds: list[Path] = []
    real = tokenizer_build.check_build

    def counted(source, **kwargs):
        builds.append(source)
        return real(source, **kwargs)

    monkeypatch.setattr(tokenizer_build, "check_build", counted)
    for _ in range(2):
        assert len(load_hf_tokenizer(path, 11)) == 11
    assert len(builds) == 1
    load_hf_tokenizer(path, 12)  # another model's vocabulary: its own bounds
    assert len(builds) == 2
    config = path / "tokenizer_config.json"
    info = config.stat()
    config.write_text(config.read_text().replace("PreTrainedTokenizerFast", "PreTrainedTokenizerFasT"))
    os.utime(config, ns=(info.st_atime_ns, info.st_mtime_ns))
    with contextlib.suppress(ModelLoadError):
        load_hf_tokenizer(path, 11)
    assert len(builds) == 3
    config.write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    (path / "special_tokens_map.json").write_text(json.dumps({"unk_token": "<unk>"}))
    load_hf_tokenizer(path, 11)
    assert len(builds) == 4
    load_hf_tokenizer(path, 11)
    assert len(builds) == 4


def test_the_helper_ends_with_the_process_that_started_it(tmp_path) -> None:
    """It reads its requests from this process: at that pipe's end (this process gone) it ends."""
    path = word_level(tmp_path / "t", 10)
    check_build(path, vocab_size=11)
    (helper,) = tokenizer_build._HELPERS.processes()
    assert helper.stdin is not None
    helper.stdin.close()  # as this process's end closes it
    assert helper.wait(30) == 0
    tokenizer_build.stop_helper()


def test_a_directory_without_a_tokenizer_starts_no_helper(tiny_models, tmp_path) -> None:
    from asyncinfer import AsyncEngine
    from tests.models.test_tokenizer_vocabulary_fits import weights_dir

    tokenizer_build.stop_helper()
    path = weights_dir(tiny_models, tmp_path / "m")
    engine = AsyncEngine.from_pretrained(path, dtype="float32", device="cpu", num_threads=1)
    assert engine.get_tokenizer() is None
    assert tokenizer_build._HELPERS.processes() == []


def test_a_gguf_files_tokenizer_is_its_own_whatever_lies_beside_it(tmp_path, monkeypatch) -> None:
    """transformers took a tokenizer.json (and tokenizer_config.json) beside the GGUF file over its vocabulary,
    unchecked: a normalizer that multiplied texts aborted the process at the first prompt (pass89). Both the bounded
    build and this process's own (where no cache can be written) build from the file alone."""
    monkeypatch.setenv("ASYNCINFER_CACHE_DIR", str(tmp_path / "cache"))
    clean = write_tokenizer_gguf((tmp_path / "clean").mkdir() or tmp_path / "clean" / "t.gguf", "{{ 'x' }}")
    reference = transformers.AutoTokenizer.from_pretrained(clean.parent, gguf_file="t.gguf")
    beside = word_level(tmp_path / "beside", 3)  # a tokenizer.json and tokenizer_config.json of 4 tokens
    path = write_tokenizer_gguf(beside / "t.gguf", "{{ 'x' }}")
    built = gguf_tokenizer(path, vocab_size=100)
    assert isinstance(built, CachedTokenizer) and built.get_vocab() == reference.get_vocab()
    (tmp_path / "cache").rename(tmp_path / "old")
    (tmp_path / "cache").write_text("a file where the cache directory should be")  # saved in a private directory
    built = gguf_tokenizer(path, vocab_size=100)
    assert built.get_vocab() == reference.get_vocab()


def test_a_killed_loads_staging_directory_is_removed_by_a_later_one(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ASYNCINFER_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tokenizer_gguf(tmp_path / "t.gguf", "{{ 'x' }}")
    staging = tmp_path / "cache" / "tokenizers"
    staging.mkdir(parents=True)
    (staging / ".tokenizer-left").mkdir()
    os.utime(staging / ".tokenizer-left", (time.time() - 7200, time.time() - 7200))
    (staging / ".tokenizer-now").mkdir()  # another load's, under way
    gguf_tokenizer(path, vocab_size=100)
    assert sorted(entry.name for entry in staging.iterdir() if entry.name.startswith(".")) == [".tokenizer-now"]


def test_a_tokenizer_file_named_as_weights_are_is_copied_and_counts(tmp_path, monkeypatch) -> None:
    """A tokenizer file transformers picks by a name ending as a weight file's (``fast_tokenizer_files``:
    ``tokenizer.4.0.json.bin``) was left out of the digest: changed, it was built here unbounded (pass89). The copy
    holds every file a tokenizer may be built from, whatever its name, and its bytes key the verdict."""
    monkeypatch.setenv("ASYNCINFER_CACHE_DIR", str(tmp_path / "cache"))
    path = word_level(tmp_path / "t", 10)
    (path / "tokenizer.json").rename(path / "tokenizer.4.0.json.bin")
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            "fast_tokenizer_files": ["tokenizer.4.0.json.bin"]}))
    (path / "tokenizer.json").write_text((path / "tokenizer.4.0.json.bin").read_text())
    (path / "model.safetensors").write_bytes(b"weights, not copied")
    builds: list[Path] = []
    real = tokenizer_build.check_build

    def counted(source, **kwargs):
        builds.append(source)
        assert sorted(entry.name for entry in source.iterdir()) == [
            "tokenizer.4.0.json.bin", "tokenizer.json", "tokenizer_config.json"]
        return real(source, **kwargs)

    monkeypatch.setattr(tokenizer_build, "check_build", counted)
    assert len(load_hf_tokenizer(path, 11)) == 11
    assert len(load_hf_tokenizer(path, 11)) == 11 and len(builds) == 1  # the verdict kept
    (path / "model.safetensors").write_bytes(b"other weights, no matter")
    assert len(load_hf_tokenizer(path, 11)) == 11 and len(builds) == 1
    chosen = path / "tokenizer.4.0.json.bin"
    info = chosen.stat()
    chosen.write_text(chosen.read_text().replace('"w1"', '"x1"'))
    os.utime(chosen, ns=(info.st_atime_ns, info.st_mtime_ns))  # same size and time, other bytes
    assert len(load_hf_tokenizer(path, 11)) == 11 and len(builds) == 2


def test_a_directory_with_a_verdict_starts_no_helper(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ASYNCINFER_CACHE_DIR", str(tmp_path / "cache"))
    path = word_level(tmp_path / "t", 10)
    assert len(load_hf_tokenizer(path, 11)) == 11
    tokenizer_build.stop_helper()
    assert len(load_hf_tokenizer(path, 11)) == 11
    assert tokenizer_build._HELPERS.processes() == []


def test_past_max_helpers_a_build_waits_for_a_free_one(tmp_path, monkeypatch) -> None:
    tokenizer_build.stop_helper()
    monkeypatch.setattr(tokenizer_build, "MAX_HELPERS", 1)
    slow = word_level(tmp_path / "slow", 10, added=300_000)
    quick = word_level(tmp_path / "quick", 10)
    ended: dict[str, float] = {}
    most = 0

    def build(name: str, path: Path, cpu: float) -> None:
        with contextlib.suppress(ModelLoadError):
            check_build(path, vocab_size=None, bounds=BuildBounds(memory_bytes=2**31, cpu_seconds=cpu,
                                                                  wall_seconds=60))
        ended[name] = time.monotonic()

    threads = [threading.Thread(target=build, args=("slow", slow, 1.5))]
    threads[0].start()
    while not tokenizer_build._HELPERS.processes():
        time.sleep(0.05)
    threads.append(threading.Thread(target=build, args=("quick", quick, 60)))
    threads[1].start()
    while any(thread.is_alive() for thread in threads):
        most = max(most, len(tokenizer_build._HELPERS.processes()))
        time.sleep(0.05)
    assert most == 1 and ended["quick"] > ended["slow"]


_CONCURRENT = """
import sys, threading
from pathlib import Path
from asyncinfer.models.checkpoint import load_hf_tokenizer
failed = []
def load():
    try:
        load_hf_tokenizer(Path(sys.argv[1]), 11)
    except BaseException as exc:
        failed.append(repr(exc))
threads = [threading.Thread(target=load) for _ in range(3)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(failed)
"""


def test_tokenizers_load_in_several_threads_at_once(tmp_path) -> None:
    """transformers imported by several threads at once failed some (``ImportError: cannot import name
    'PreTrainedTokenizerBase'``, pass89): imported under a lock."""
    path = word_level(tmp_path / "t", 10)
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _CONCURRENT, str(path)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)]),
                               "ASYNCINFER_CACHE_DIR": str(tmp_path / "cache")}, check=False)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr[-2000:]


def test_a_json_file_transformers_cannot_read_is_named(tmp_path) -> None:
    """Python's JSON error ("Expecting property name ...: line 1 column 2") named no file (stranger80)."""
    path = word_level(tmp_path / "t", 10)
    (path / "tokenizer_config.json").write_text("{bad")
    with pytest.raises(ModelLoadError, match=r"^cannot load the tokenizer in .*/t: tokenizer_config\.json is not valid "
                                             r"JSON: Expecting property name enclosed in double quotes: line 1 "
                                             r"column 2 \(char 1\)$"):
        load_hf_tokenizer(path, 11)


def test_a_link_to_a_kernels_file_is_refused_not_read(tmp_path) -> None:
    """The digest read every small file before the checks that refuse the kernel's files: a link to
    /proc/self/pagemap (which says 0 bytes and reads hundreds of GiB) hung the load (pass90). A file is read no
    further than its size, and one of size 0 is not opened."""
    path = word_level(tmp_path / "t", 10)
    (path / "notes.txt").symlink_to("/proc/self/pagemap")
    done: list[BaseException] = []

    def load() -> None:
        try:
            load_hf_tokenizer(path, 11)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            done.append(exc)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the load hung"
    assert isinstance(done[0], ModelLoadError) and "it is the kernel's file /proc/" in str(done[0]), done


def test_the_files_built_here_are_those_the_bounded_build_saw(tmp_path, monkeypatch) -> None:
    """A tokenizer.json swapped in the directory after the bounded build was built here, unbounded (pass90): both
    builds read one private copy of the files."""
    monkeypatch.setenv("ASYNCINFER_CACHE_DIR", str(tmp_path / "cache"))
    path = word_level(tmp_path / "t", 10)
    swapped = word_level(tmp_path / "other", 10, added=5)
    real = tokenizer_build.check_build_once

    def then_swap(source, **kwargs):
        report = real(source, **kwargs)
        (path / "tokenizer.json").write_bytes((swapped / "tokenizer.json").read_bytes())
        return report

    monkeypatch.setattr(tokenizer_build, "check_build_once", then_swap)
    tokenizer = load_hf_tokenizer(path, 11)
    assert len(tokenizer) == 11 and tokenizer.name_or_path == str(path)
    assert not list(Path(tempfile.gettempdir()).glob(f"asyncinfer-tokenizer-*/{path.name}"))  # the copy is gone


def test_private_directories_a_killed_process_left_are_removed(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / "asyncinfer-gguf-left").mkdir()
    old = time.time() - tokenizer_build.STALE_DIR_HOURS * 3600 - 60
    os.utime(tmp_path / "asyncinfer-gguf-left", (old, old))
    (tmp_path / "asyncinfer-gguf-now").mkdir()  # another process's, under way
    made = tokenizer_build.fresh_dir("asyncinfer-gguf-")
    assert sorted(entry.name for entry in tmp_path.iterdir()) == sorted(["asyncinfer-gguf-now", made.name])


_NO_ROOM = """
import resource, sys
from pathlib import Path
resource.setrlimit(resource.RLIMIT_FSIZE, (2**16, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
from asyncinfer.models.checkpoint import load_hf_tokenizer
try:
    load_hf_tokenizer(Path(sys.argv[1]), 5001)
except Exception as exc:
    print(type(exc).__name__, exc)
"""


def test_a_private_copy_that_cannot_be_written_says_so(tmp_path) -> None:
    """A copy cut short (no room left, here a 64 KiB limit on a file's size) was built half-written and refused as
    JSON that does not parse, naming no cause (pass91)."""
    path = word_level(tmp_path / "t", 5000)  # a tokenizer.json of some 80 KB
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _NO_ROOM, str(path)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)]),
                               "ASYNCINFER_CACHE_DIR": str(tmp_path / "cache")}, check=False)
    said = done.stdout.strip()
    assert said.startswith(f"ModelLoadError cannot copy {path}/tokenizer.json to a private directory ("), said
    assert "to build the tokenizer from: [Errno 27] File too large" in said and "TMPDIR" in said, said


def test_only_the_files_a_tokenizer_is_built_from_are_copied_and_within_a_total(tmp_path) -> None:
    """Every file named ``tokenizer*`` was copied, each up to 1 GiB: three sparse 300 MB files (3 MB on disk) wrote
    900 MiB to the temporary directory at each load (pass92). The copy holds what a tokenizer is built from, their
    sizes summed against one limit before anything is copied."""
    path = word_level(tmp_path / "t", 10)
    with open(path / "tokenizer_backup.bin", "wb") as sparse:
        sparse.truncate(300 * 2**20)
    assert len(load_hf_tokenizer(path, 11)) == 11
    with open(path / "vocab.txt", "wb") as sparse:  # a slow tokenizer's file: copied, but held to the vocabulary
        sparse.truncate(300 * 2**20)
    with pytest.raises(ModelLoadError, match=r"^the tokenizer's files in .*/t take \d+ bytes together, more than a "
                                             r"tokenizer of this model may \(268435456: 4 times the larger of 64 MiB "
                                             r"and 512 bytes a token of the model's vocab_size 11 and 1 MiB\); the "
                                             r"largest is vocab\.txt, 314572800 bytes"):
        load_hf_tokenizer(path, 11)  # (pass94: a sparse file the checks refuse was first written out whole)
    (path / "vocab.txt").unlink()
    names = ["tokenizer.json", "tokenizer_config.json"]
    with tokenizer_build.private_copy(path, names, 2**20) as copy:
        assert sorted(entry.name for entry in copy.path.iterdir()) == names
    total = sum((path / name).stat().st_size for name in names)
    refused = (rf"^the tokenizer's files in .*/t take {total} bytes together, more than a tokenizer of this model may "
               rf"\({total - 1}\); the largest is tokenizer\.json, \d+ bytes \(before anything is copied or read\)$")
    with pytest.raises(ModelLoadError, match=refused), tokenizer_build.private_copy(path, names, total - 1):
        pass


def test_the_helper_imports_nothing_from_the_working_directory(tmp_path) -> None:
    """The helper ran ``python -c`` with the working directory first on its path: a json.py there ran in it, and
    every tokenizer load failed (pass92)."""
    path = word_level(tmp_path / "t", 10)
    here = tmp_path / "here"
    here.mkdir()
    (here / "json.py").write_text('raise SystemExit("the working directory\'s json.py ran")\n')
    root = Path(__file__).resolve().parents[2]
    code = ("import sys; sys.path.remove('') if '' in sys.path else None\n"
            "from pathlib import Path\nfrom asyncinfer.models.checkpoint import load_hf_tokenizer\n"
            "print(len(load_hf_tokenizer(Path(sys.argv[1]), 11)))\n")
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120,
                          cwd=here, check=False,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)]),
                               "ASYNCINFER_CACHE_DIR": str(tmp_path / "cache")})
    assert done.stdout.strip() == "11", done.stdout + done.stderr[-2000:]


def test_a_tokenizer_json_the_library_cannot_read_is_named(tmp_path) -> None:
    """The tokenizers library's refusal ("data did not match any variant of untagged enum ModelUntagged at line 1
    column N") named no file and said nothing to do (stranger84)."""
    path = word_level(tmp_path / "t", 10)
    data = json.loads((path / "tokenizer.json").read_text())
    data["model"]["type"] = "Foo"
    (path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ModelLoadError, match=r"^cannot load the tokenizer in .*/t: tokenizer\.json is not a tokenizer "
                                             r"the tokenizers library can read \(.* at line 1 column \d+\): copy the "
                                             r"model's own tokenizer files beside its config\.json$"):
        load_hf_tokenizer(path, 11)


def test_a_helper_that_ends_idle_is_reaped_at_once(tmp_path) -> None:
    """A helper that ended after its idle time stayed a defunct child of the serving process until the next build
    (stranger85): a thread of its own reaps it (here it is ended by a kill, as its idle end would)."""
    tokenizer_build.stop_helper()
    check_build(word_level(tmp_path / "t", 10), vocab_size=11)
    (helper,) = tokenizer_build._HELPERS.processes()
    os.kill(helper.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{helper.pid}").exists():
        assert time.monotonic() < deadline, (Path(f"/proc/{helper.pid}/stat").read_text())
        time.sleep(0.05)


def test_a_keyboard_interrupt_in_the_loaders_thread_ends_the_build_at_once(tmp_path) -> None:
    """Ctrl-C during a load raises KeyboardInterrupt in the loader's thread, which lands between bytecodes: the thread
    waited in one select() for the build's answer, up to its wall-clock limit (pass94). It waits in short polls."""
    import ctypes

    slow = word_level(tmp_path / "slow", 10, added=600_000)
    tokenizer_build.prepare()
    ended: list[BaseException] = []

    def build() -> None:
        try:
            check_build(slow, vocab_size=None, bounds=BuildBounds(memory_bytes=2**31, cpu_seconds=60, wall_seconds=120))
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            ended.append(exc)

    thread = threading.Thread(target=build, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not any(len(_group(process.pid)) > 1 for process in tokenizer_build._HELPERS.processes()):
        assert time.monotonic() < deadline
        time.sleep(0.05)  # the build forked
    asked = time.monotonic()
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(KeyboardInterrupt))
    thread.join(10)
    assert not thread.is_alive() and isinstance(ended[0], KeyboardInterrupt)
    assert time.monotonic() - asked < 5


def test_a_keyboard_interrupt_while_waiting_for_a_free_helper_lands_at_once(tmp_path, monkeypatch) -> None:
    """Past MAX_HELPERS a build waited on a condition with no timeout: Ctrl-C in its thread landed only when a helper
    was freed, up to another build's wall-clock limit (pass95)."""
    from asyncinfer import threads

    tokenizer_build.stop_helper()
    monkeypatch.setattr(tokenizer_build, "MAX_HELPERS", 1)
    slow = word_level(tmp_path / "slow", 10, added=600_000)
    quick = word_level(tmp_path / "quick", 10)
    def hold() -> None:
        with contextlib.suppress(ModelLoadError):  # (ended by stop_helper below)
            check_build(slow, vocab_size=None, bounds=BuildBounds(memory_bytes=2**31, cpu_seconds=60, wall_seconds=120))

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    while not tokenizer_build._HELPERS.processes():
        time.sleep(0.05)
    ended: list[BaseException] = []

    def waiting() -> None:
        try:
            check_build(quick, vocab_size=11)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            ended.append(exc)

    thread = threading.Thread(target=waiting, daemon=True)
    thread.start()
    time.sleep(1)  # waiting for the one helper
    asked = time.monotonic()
    threads._raise_in(thread, KeyboardInterrupt)
    thread.join(10)
    assert not thread.is_alive() and isinstance(ended[0], KeyboardInterrupt)
    assert time.monotonic() - asked < 5
    tokenizer_build.stop_helper()
    holder.join(30)


def test_an_interrupt_is_never_raised_while_a_thread_is_being_started() -> None:
    """A thread not yet running carries its creator's id: an exception raised in the creator then killed the new
    thread before it said it had started, and the creator waited in Thread.start() for ever (a Ctrl-C as a load started
    a helper's reaper thread hung the process: pass95). Raising waits for a start in progress."""
    from asyncinfer import threads

    def sleep() -> None:
        with contextlib.suppress(KeyboardInterrupt):
            time.sleep(0.5)
            time.sleep(0.5)

    target = threading.Thread(target=sleep, daemon=True)
    target.start()
    raised = threading.Event()
    with threads._STARTING:  # a start in progress
        raiser = threading.Thread(target=lambda: (threads._raise_in(target, KeyboardInterrupt), raised.set()),
                                  daemon=True)
        raiser.start()
        assert not raised.wait(0.3)
    assert raised.wait(5)
    target.join(5)
