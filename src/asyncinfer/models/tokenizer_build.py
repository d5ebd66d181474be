"""A tokenizer's first build from a model's files, run in a separate process bounded in memory and CPU time.

transformers (and the tokenizers library under it) builds a tokenizer from whatever a model directory or a GGUF
file holds: a vocabulary, merges, added tokens, normalizer tables, a SentencePiece or tiktoken file to convert.
The checks of :mod:`asyncinfer.models.checkpoint` refuse, before anything is built, what is known to cost more than
the model warrants; this module bounds the rest. The build is first made by a child process that may take at most
:func:`build_bounds`'s memory and CPU time (a limit on its heap, ``RLIMIT_DATA``, and on its CPU seconds,
``RLIMIT_CPU``, with a wall-clock limit above them); it reports the number of tokens it built (refused when the
model embeds fewer) and, for a GGUF file, saves the tokenizer for the serving process to load (built from the
file's metadata alone, :func:`gguf_only`). The serving process builds a directory's tokenizer itself only after the
child built the same files within those bounds: both build from one private copy of them (:func:`private_copy`),
and the verdict is kept for the same files (:func:`check_build_once`).

The child is forked from a helper process that has imported transformers once (a fork costs milliseconds, the
import seconds), in a process group of its own; a helper is started on first use (or ahead of it, by :func:`prepare`),
serves one build at a time (a build takes an idle helper or starts one, up to :data:`MAX_HELPERS`), and ends after
:data:`IDLE_SECONDS` without one, or with the process that started it, its build with it. Where ``fork`` does not
exist (Windows) each build starts a helper of its own. The memory limit is enforced where the kernel enforces
``RLIMIT_DATA`` (Linux); elsewhere only the time limits hold.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from asyncinfer.errors import ModelLoadError
from asyncinfer.models.hf_imports import transformers_imports
from asyncinfer.threads import start_thread

logger = logging.getLogger(__name__)

#: The memory a build may take, beyond the helper's own, whatever the model (MiB).
BASE_MEMORY_MIB = 1024
#: ... and per token of the model's vocabulary (KiB): 262,144 tokens (Gemma 3) may take 3 GiB in all.
MEMORY_KIB_PER_TOKEN = 8
#: The CPU seconds a build may take whatever the model (SmolLM2's GGUF vocabulary of 49,152 tokens takes ~5 s here).
BASE_CPU_SECONDS = 60.0
#: ... and per token of the model's vocabulary (ms): 262,144 tokens may take 322 s.
CPU_MS_PER_TOKEN = 1.0
#: The wall-clock time a build may take, as a multiple of its CPU time (a loaded machine shares its cores).
WALL_PER_CPU = 3.0
#: The seconds the helper process waits for the next build before it ends (its ~300 MiB are then given back).
IDLE_SECONDS = 120.0
#: The most helper processes at once (each ~300 MiB, and its build's bounds): more builds at once wait for one.
MAX_HELPERS = 4
#: The most characters of a failed build's message (or its stderr) passed on.
MESSAGE_CHARS = 2000

_VOCABULARY_WHEN_UNKNOWN = 262_144  # the bounds of a build whose model's vocabulary size is not known


@dataclass(frozen=True)
class BuildBounds:
    """What one tokenizer build may take: heap bytes beyond the helper's own, CPU seconds, wall-clock seconds."""

    memory_bytes: int
    cpu_seconds: float
    wall_seconds: float


def build_bounds(vocab_size: int | None) -> BuildBounds:
    """The bounds of a build for a model that embeds ``vocab_size`` tokens (the largest usual vocabulary's when
    None): in proportion to it, so that a real tokenizer builds well within them and a file that claims far more
    than its model fails early."""
    tokens = _VOCABULARY_WHEN_UNKNOWN if vocab_size is None else max(0, vocab_size)
    cpu = BASE_CPU_SECONDS + tokens * CPU_MS_PER_TOKEN / 1000
    return BuildBounds(memory_bytes=BASE_MEMORY_MIB * 2**20 + tokens * MEMORY_KIB_PER_TOKEN * 2**10,
                       cpu_seconds=cpu, wall_seconds=cpu * WALL_PER_CPU + 30)


@dataclass(frozen=True)
class BuildReport:
    """What the bounded build made: its number of tokens (``len(tokenizer)``) and its class's qualified name."""

    tokens: int
    tokenizer_class: str


def check_build(source: Path, *, vocab_size: int | None, gguf_file: str | None = None,
                save_to: Path | None = None, bounds: BuildBounds | None = None, shown: Path | None = None) -> BuildReport:
    """Build the tokenizer of ``source`` (a directory; with ``gguf_file``, the GGUF file of that name in it) in a
    child process within ``bounds`` (:func:`build_bounds` of ``vocab_size`` by default), and refuse it when it fails,
    exceeds them, or holds more tokens than ``vocab_size``. With ``save_to`` (an empty directory), the child saves the
    tokenizer there (``save_pretrained``).

    Raises:
        ModelLoadError: the build failed (transformers' message), ran out of memory or time, or made more tokens than
            the model embeds; each names ``source`` (``shown`` where given: the directory ``source`` is a private
            copy of, :func:`private_copy`) and, for a limit, its value.
    """
    where = shown if shown is not None else source / gguf_file if gguf_file is not None else source
    bounds = bounds if bounds is not None else build_bounds(vocab_size)
    request = {"source": str(source), "gguf_file": gguf_file, "save_to": None if save_to is None else str(save_to),
               "memory_bytes": bounds.memory_bytes, "cpu_seconds": bounds.cpu_seconds,
               "wall_seconds": bounds.wall_seconds}
    answer = _HELPERS.build(request, bounds.wall_seconds + 60)
    if answer.get("ok"):
        report = BuildReport(tokens=int(answer["tokens"]), tokenizer_class=str(answer["class"]))
        if vocab_size is not None and report.tokens > vocab_size:
            raise ModelLoadError(f"the tokenizer of {where} has {report.tokens} tokens (built in a separate process, "
                                 f"refused before this one builds it) but the model embeds only {vocab_size}"
                                 + ("" if gguf_file is not None else ": is it another model's tokenizer? Copy this "
                                    "model's own tokenizer files beside its config.json"))
        return report
    reason, message = answer.get("reason"), str(answer.get("message", ""))[:MESSAGE_CHARS]
    if shown is not None:
        message = message.replace(str(source), str(shown))
    if reason == "memory":
        raise ModelLoadError(
            f"building the tokenizer of {where} took more than {bounds.memory_bytes // 2**20} MiB, the most a "
            f"tokenizer of {_a_model(vocab_size)} may take (built in a separate process, which ran out of it: "
            f"{message})")
    if reason == "time":
        raise ModelLoadError(
            f"building the tokenizer of {where} took more than {message}, the most a tokenizer of {_a_model(vocab_size)} "
            f"may take ({_seconds(bounds.cpu_seconds)} of CPU, {_seconds(bounds.wall_seconds)} in all; built in a separate "
            f"process, which was stopped)")
    if reason == "helper":
        raise ModelLoadError(f"cannot build the tokenizer of {where}: the process that builds it failed: {message}")
    raise BuildFailed(where, message, panicked=reason == "panic")


def _seconds(value: float) -> str:
    return f"{value:.0f} s" if value >= 10 else f"{value:g} s"


def _a_model(vocab_size: int | None) -> str:
    return f"a model of {vocab_size} tokens" if vocab_size is not None else "a model of unknown vocabulary size"


class BuildFailed(ModelLoadError):
    """transformers could not build the tokenizer (its message, on one line, is :attr:`said`); the caller words the
    refusal (it knows which files the directory lacks)."""

    def __init__(self, where: Path, said: str, *, panicked: bool) -> None:
        self.said = said
        self.panicked = panicked
        super().__init__(f"cannot load the tokenizer of {where}: "
                         + (f"the tokenizers library panicked reading it: {said}" if panicked else said))


#: How many verdicts :func:`check_build_once` keeps (the oldest are removed past it).
KEPT_VERDICTS = 256
_COPY_CHUNK = 2**20


def check_build_once(source: PrivateCopy, *, vocab_size: int | None, shown: Path | None = None) -> BuildReport:
    """:func:`check_build` of a private copy of a directory's tokenizer files (:func:`private_copy`), once for the
    same files: its verdict is kept (in the user cache's ``tokenizers/verdicts/``, the last :data:`KEPT_VERDICTS`)
    under the copy's digest, ``vocab_size`` and transformers' and tokenizers' versions; files of a verdict are not
    built in a separate process again (nor is a helper started for them). Where the verdict cannot be kept, the
    next load builds again.

    Raises:
        ModelLoadError: as :func:`check_build`.
    """
    record = _verdict_file(source.digest, vocab_size)
    known = _known_verdict(record)
    if known is not None:
        return known
    report = check_build(source.path, vocab_size=vocab_size, shown=shown)
    verdicts = record.parent
    try:
        verdicts.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=verdicts, prefix=".verdict-", delete=False) as staged:
            json.dump({"tokens": report.tokens, "class": report.tokenizer_class}, staged)
        os.replace(staged.name, record)
        kept = sorted(verdicts.glob("*.json"), key=lambda entry: entry.stat().st_mtime_ns)
        for old in kept[:-KEPT_VERDICTS]:
            old.unlink(missing_ok=True)
        remove_stale(verdicts, ".verdict-", 3600)  # (a write that failed half-way)
    except OSError as exc:
        logger.warning("could not keep the tokenizer's verdict in %s: %s", verdicts, exc)
    return report


def has_verdict(source: PrivateCopy, vocab_size: int | None) -> bool:
    """Whether :func:`check_build_once` of these files will find its verdict kept (no build, no helper)."""
    return _known_verdict(_verdict_file(source.digest, vocab_size)) is not None


#: Part of every verdict's key: a new value when what a verdict stands for changes (the bounds, the checks).
VERDICT_FORMAT = 2


def _verdict_file(digest: str, vocab_size: int | None) -> Path:
    import hashlib
    import importlib.metadata

    from asyncinfer.model_source import cache_dir

    versions = [importlib.metadata.version(name) for name in ("transformers", "tokenizers")]
    key = hashlib.sha256(json.dumps([VERDICT_FORMAT, digest, vocab_size, versions]).encode()).hexdigest()
    return cache_dir() / "tokenizers" / "verdicts" / f"{key[:32]}.json"


def _known_verdict(record: Path) -> BuildReport | None:
    try:
        known = json.loads(record.read_bytes())
        return BuildReport(tokens=int(known["tokens"]), tokenizer_class=str(known["class"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class PrivateCopy:
    """A directory's tokenizer files copied (:func:`private_copy`): where, and the digest of what was copied."""

    path: Path
    digest: str


@contextlib.contextmanager
def private_copy(source: Path, names: list[str], limit: int, limit_said: str = "") -> Iterator[PrivateCopy]:
    """A copy of the files ``names`` (relative paths) of the directory ``source`` that are regular files there, of at
    most ``limit`` bytes together (their sizes, sparse or not, summed before anything is copied), private to this
    process and removed after the block: every check of a tokenizer's
    files and both its builds (bounded, then in this process) read the same bytes (a file swapped in the directory
    between them was built unchecked, unbounded); the digest of the names and bytes copied keys the verdict. A file
    is read no further than its size says (a kernel's file, which says 0, is not opened: the caller refuses those
    first).

    Raises:
        ModelLoadError: files past ``limit`` together, one that cannot be read, or a copy that cannot be written
            (naming the temporary directory: a full disk).
    """
    import hashlib
    import stat

    files: list[tuple[str, os.stat_result]] = []
    for name in sorted(set(names)):
        try:
            info = (source / name).stat()
        except OSError:
            continue  # (no such file: none is copied)
        if stat.S_ISREG(info.st_mode):
            files.append((name, info))
    total = sum(info.st_size for _, info in files)
    if total > limit:
        largest, info = max(files, key=lambda item: item[1].st_size)
        raise ModelLoadError(f"the tokenizer's files in {source} take {total} bytes together, more than a tokenizer "
                             f"of this model may ({limit}{': ' + limit_said if limit_said else ''}); the largest is {largest}, {info.st_size} "
                             "bytes (before anything is copied or read)")
    root = fresh_dir("asyncinfer-tokenizer-")
    try:
        digest = hashlib.blake2b(digest_size=32)
        for name, info in files:
            entry, target = source / name, root / name
            content = hashlib.blake2b(digest_size=32)
            size = 0
            with contextlib.ExitStack() as held:
                try:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    out = held.enter_context(open(target, "xb", buffering=0))  # (a full disk fails the write)
                    source_file = held.enter_context(open(entry, "rb")) if info.st_size else None
                except OSError as exc:
                    raise _copy_error(entry, root, exc) from exc
                # (not opened at size 0: a kernel's file says 0, and some wait on a read)
                while source_file is not None and size < info.st_size:
                    try:
                        chunk = source_file.read(min(_COPY_CHUNK, info.st_size - size))
                    except OSError as exc:
                        raise ModelLoadError(f"cannot read {entry}: {exc}") from exc
                    if not chunk:
                        break
                    content.update(chunk)
                    try:
                        _write_all(out, chunk)
                    except OSError as exc:
                        raise _copy_error(entry, root, exc, writing=True) from exc
                    size += len(chunk)
            digest.update(json.dumps([name, size, content.hexdigest()]).encode() + b"\n")  # one JSON line a file
        yield PrivateCopy(root, digest.hexdigest())
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _write_all(out: IO[bytes], chunk: bytes) -> None:
    """Write all of ``chunk`` to the unbuffered ``out`` (a write past a file-size limit, or a disk's end, writes
    part of it; the next one fails)."""
    view = memoryview(chunk)
    while view:
        written = out.write(view)
        if not written:
            raise OSError(28, "No space left on device")
        view = view[written:]


def _copy_error(entry: Path, root: Path, exc: OSError, *, writing: bool = False) -> ModelLoadError:
    if writing or (exc.filename is not None and str(exc.filename).startswith(str(root))):
        return ModelLoadError(f"cannot copy {entry} to a private directory ({root}) to build the tokenizer from: "
                              f"{exc} (the system's temporary directory: TMPDIR chooses another)")
    return ModelLoadError(f"cannot read {entry}: {exc}")


#: A private directory older than this (hours) is one a killed process left: removed by the next one made.
STALE_DIR_HOURS = 1


def fresh_dir(prefix: str) -> Path:
    """A new private directory in the system's temporary directory (those of ``prefix`` that killed processes left,
    :data:`STALE_DIR_HOURS` old, removed first)."""
    remove_stale(Path(tempfile.gettempdir()), prefix, STALE_DIR_HOURS * 3600)
    return Path(tempfile.mkdtemp(prefix=prefix))


def remove_stale(folder: Path, prefix: str, seconds: float) -> None:
    """Remove the entries of ``folder`` named ``prefix*`` left more than ``seconds`` ago (by killed processes)."""
    for left in folder.glob(f"{prefix}*"):
        with contextlib.suppress(OSError):
            if time.time() - left.lstat().st_mtime > seconds:
                if left.is_dir() and not left.is_symlink():
                    shutil.rmtree(left, ignore_errors=True)
                else:
                    left.unlink()


def stop_helper() -> None:
    """End the helper processes now (each ends by itself after :data:`IDLE_SECONDS` without a build, or with this
    process), and the builds they run; the next build starts another."""
    _HELPERS.stop()


def prepare() -> None:
    """Start a helper process now (where ``fork`` exists), so that its import of transformers overlaps this
    process's; a no-op while an idle one runs."""
    _HELPERS.start()


def gguf_only(path: Path, auto: Any) -> Any:
    """The tokenizer transformers' ``auto`` (``AutoTokenizer``) builds from the GGUF file ``path``'s metadata alone:
    from a directory of its own that holds only a link to it (beside the file, transformers takes a
    ``tokenizer.json`` and ``tokenizer_config.json`` of the directory over the file's vocabulary, unchecked)."""
    alone = fresh_dir("asyncinfer-gguf-")
    try:
        os.symlink(os.path.abspath(path), alone / path.name)
        return auto.from_pretrained(alone, gguf_file=path.name)
    finally:
        shutil.rmtree(alone, ignore_errors=True)


def auto_tokenizer() -> Any:
    """transformers' ``AutoTokenizer``, imported under :func:`~asyncinfer.models.hf_imports.transformers_imports`'s
    lock (two models loading at once in threads of their own)."""
    with transformers_imports():
        from transformers import AutoTokenizer

        return AutoTokenizer


# ---- the serving process's side: helpers, one build each at a time ----------------------------------------------

_FORKS = os.name == "posix" and sys.platform != "emscripten"


class _Helper:
    """One helper process, in a process group of its own (a Ctrl-C at the terminal is the serving process's to
    handle; stopping the helper kills the group, its build with it): one request at a time."""

    def __init__(self) -> None:
        self._stopping = threading.Lock()
        self._stopped = False
        self.stderr: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 - the helper's, held while it runs
        code = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
                "from asyncinfer.models.tokenizer_build import serve; "
                "serve(fork=sys.argv[2] == 'fork', parent=int(sys.argv[3]))")
        try:
            if not sys.executable:
                raise OSError("this Python cannot start another (sys.executable is empty: an embedded interpreter)")
            self.process = subprocess.Popen(
                # -I: nothing of the working directory (a json.py there ran first) nor PYTHON* variables: the
                # serving process's sys.path is given whole
                [sys.executable, "-I", "-c", code, json.dumps(sys.path), "fork" if _FORKS else "once",
                 str(os.getpid())],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, close_fds=True,
                start_new_session=_FORKS)
        except BaseException:
            self.stderr.close()
            raise

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        """Kill the helper and whatever build it runs (its process group), and reap it; once (a build's thread and
        :func:`stop_helper` may both stop it)."""
        with self._stopping:
            if self._stopped:
                return
            self._stopped = True
            # (its process group's id is its pid, which no other process can take before it is reaped here)
            if self.process.poll() is None:
                with contextlib.suppress(OSError):
                    if _FORKS:
                        os.killpg(self.process.pid, signal.SIGKILL)
                    else:
                        self.process.kill()
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                self.process.wait(5)
            for pipe in (self.process.stdin, self.process.stdout):
                with contextlib.suppress(OSError):
                    if pipe is not None:
                        pipe.close()
            self.stderr.close()

    def said(self) -> str:
        """The end of the helper's stderr (why it ended)."""
        try:
            self.stderr.seek(0, os.SEEK_END)
            self.stderr.seek(max(0, self.stderr.tell() - MESSAGE_CHARS))
            return " ".join(self.stderr.read().decode("utf-8", "replace").split())
        except (OSError, ValueError):
            return ""

    def ask(self, request: dict[str, Any], timeout: float) -> dict[str, Any] | None:
        """Send the request, wait for the answer line: None when the helper ended (or stopped answering)."""
        assert self.process.stdin is not None and self.process.stdout is not None
        try:
            self.process.stdin.write(json.dumps(request).encode() + b"\n")
            self.process.stdin.flush()
        except OSError:
            return None
        try:
            line = _read_line(self.process.stdout.fileno(), timeout)
        except (OSError, ValueError):  # stopped meanwhile (stop_helper): its pipe closed
            return None
        if not line:
            return None
        try:
            answer = json.loads(line)
        except ValueError:
            return None
        return answer if isinstance(answer, dict) else None


class _Helpers:
    """The helpers of this process: each build takes an idle one, or starts one (so that a long build never holds
    up another model's load), up to :data:`MAX_HELPERS` at once (past them a build waits for one to be free); a
    helper goes back to the idle ones after its build, and ends by itself after :data:`IDLE_SECONDS` without one."""

    def __init__(self) -> None:
        self._lock = threading.Condition()  # held only to take or give back a helper, never during a build
        self._idle: list[_Helper] = []
        self._all: set[_Helper] = set()
        self._starting = 0  # helpers being started (counted against MAX_HELPERS)

    def _take(self) -> _Helper:
        with self._lock:
            while True:
                while self._idle:
                    helper = self._idle.pop()
                    if helper.alive():
                        return helper
                    self._all.discard(helper)
                    helper.stop()
                if len(self._all) + self._starting < MAX_HELPERS:
                    self._starting += 1
                    break
                self._lock.wait(_POLL_SECONDS)  # (a KeyboardInterrupt in this thread lands between the waits)
        return self._new(idle=False)

    def _reap(self, helper: _Helper) -> None:
        """Wait for ``helper`` to end (after :data:`IDLE_SECONDS` idle, or stopped), then let it go: reaped at once,
        never a defunct child of the serving process until the next build."""
        with contextlib.suppress(Exception):
            helper.process.wait()
        with self._lock:
            busy = helper in self._all and helper not in self._idle  # its build's thread lets it go, and says why
            if not busy:
                self._all.discard(helper)
                if helper in self._idle:
                    self._idle.remove(helper)
                self._lock.notify_all()
        if not busy:
            helper.stop()

    def _new(self, *, idle: bool) -> _Helper:
        """Start a helper, whose place the caller counted in ``_starting`` (under the lock), and the thread that reaps
        it when it ends."""
        try:
            helper = _Helper()
        except BaseException:
            with self._lock:
                self._starting -= 1
                self._lock.notify_all()
            raise
        with self._lock:
            self._starting -= 1
            self._all.add(helper)
            if idle:
                self._idle.append(helper)
            self._lock.notify_all()
        start_thread(threading.Thread(target=self._reap, args=(helper,), name="asyncinfer-tokenizer-helper",
                                      daemon=True))
        return helper

    def _give_back(self, helper: _Helper) -> None:
        with self._lock:
            if _FORKS and helper.alive() and helper in self._all:
                self._idle.append(helper)
                self._lock.notify_all()
                return
        self._end(helper)

    def _end(self, helper: _Helper) -> None:
        with self._lock:
            self._all.discard(helper)
            self._lock.notify_all()
        helper.stop()

    def start(self) -> None:
        """One idle helper at least (where ``fork`` exists, and below :data:`MAX_HELPERS`)."""
        if not _FORKS:
            return  # each build starts its own
        with self._lock:
            if any(helper.alive() for helper in self._idle) or len(self._all) + self._starting >= MAX_HELPERS:
                return
            self._starting += 1
        with contextlib.suppress(OSError):  # (the build that needs one says why none starts)
            self._new(idle=True)

    def stop(self) -> None:
        """End every helper, and the builds they run."""
        with self._lock:
            helpers, self._idle, self._all = list(self._all), [], set()
            self._lock.notify_all()
        for helper in helpers:
            helper.stop()

    def processes(self) -> list[subprocess.Popen[bytes]]:
        """The helper processes running now (those that ended, idle, are let go)."""
        with self._lock:
            ended = [helper for helper in self._all if not helper.alive()]
            for helper in ended:
                self._all.discard(helper)
                if helper in self._idle:
                    self._idle.remove(helper)
            running = [helper.process for helper in self._all]
        for helper in ended:
            helper.stop()
        return running

    def build(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        for attempt in (1, 2):
            try:
                helper = self._take()
            except OSError as exc:
                return {"ok": False, "reason": "helper", "message": f"it could not be started: {exc}"}
            try:
                answer = helper.ask(request, timeout)
            except BaseException:  # (Ctrl-C): the build is abandoned, and its helper with it
                self._end(helper)
                raise
            if answer is not None:
                self._give_back(helper)
                return answer
            try:
                ended: int | None = helper.process.wait(2)
            except subprocess.TimeoutExpired:
                ended = None
            said = helper.said()
            self._end(helper)
            if ended is None:
                return {"ok": False, "reason": "helper", "message": f"it did not answer within {timeout:.0f} s"}
            if ended != 0 or attempt == 2:  # (an idle helper ends with 0, maybe just now: another one is started)
                return {"ok": False, "reason": "helper",
                        "message": f"it ended (exit status {ended}){': ' + said if said else ''}"}
        raise AssertionError("unreachable")


#: The longest one wait on a pipe blocks: a KeyboardInterrupt raised in a loader's thread (Ctrl-C during a load, which
#: lands between bytecodes) is taken within it, not when the build ends (up to its wall-clock limit).
_POLL_SECONDS = 0.2


def _read_line(fd: int, timeout: float) -> bytes:
    """One line from ``fd`` within ``timeout`` seconds (empty at its end or past the time)."""
    data = bytearray()
    deadline = time.monotonic() + timeout
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            return b""
        if not select.select([fd], [], [], min(left, _POLL_SECONDS))[0]:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return b""
        data += chunk
    return bytes(data)


_HELPERS = _Helpers()
atexit.register(_HELPERS.stop)  # (it would end by itself, at its stdin's end: this is sooner)


# ---- the helper process -------------------------------------------------------------------------------------------


def serve(*, fork: bool = True, parent: int = 0) -> None:
    """The helper's loop: import transformers once, then for each request line on stdin fork a child that builds
    the tokenizer within its limits, and answer one JSON line on stdout; end at stdin's end (the serving process,
    ``parent``, has ended or given it up: a build under way is killed then) or after :data:`IDLE_SECONDS` without a
    request. Without ``fork``, build the one request in this process, within its limits, and end."""
    if parent and os.getppid() != parent:
        return  # the serving process ended while this one started
    import warnings

    import transformers  # noqa: F401 - imported once, before the forks
    from transformers import AutoTokenizer  # noqa: F401

    warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)  # its one thread forks
    stdin, stdout = sys.stdin.buffer.fileno(), sys.stdout.buffer
    while True:
        line = _read_line(stdin, IDLE_SECONDS)
        if not line:
            return
        try:
            request = json.loads(line)
            if fork:
                answer = _build_in_child(request, stdin)
            else:
                _limit(int(request["memory_bytes"]), float(request["cpu_seconds"]))
                answer = _build(request)
        except Exception as exc:  # noqa: BLE001 - answered, never a silent end
            answer = {"ok": False, "reason": "helper", "message": f"{type(exc).__name__}: {exc}"}
        stdout.write(json.dumps(answer).encode() + b"\n")
        stdout.flush()
        if not fork:
            return


def _build_in_child(request: dict[str, Any], stdin: int) -> dict[str, Any]:
    """Fork a child that builds within the request's limits; its answer, or why it gave none. The child ends with
    this process (Linux: its parent-death signal); at ``stdin``'s end (the serving process gone) it is killed, and
    this process ends."""
    helper = os.getpid()
    with tempfile.TemporaryFile() as stderr:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child
            status = 1
            try:
                _die_with(helper)
                os.close(read)
                devnull = os.open(os.devnull, os.O_RDWR)
                os.dup2(devnull, 0)
                os.dup2(devnull, 1)
                os.dup2(stderr.fileno(), 2)
                _limit(int(request["memory_bytes"]), float(request["cpu_seconds"]))
                answer = _build(request)
                with os.fdopen(write, "wb") as out:
                    out.write(json.dumps(answer).encode())
                status = 0
            finally:
                os._exit(status)
        os.close(write)
        wall = float(request["wall_seconds"])
        data, timed_out, orphaned = _child_answer(read, wall, stdin)
        if timed_out or orphaned:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        _, status, usage = os.wait4(pid, 0)
        if orphaned:
            os._exit(0)
        stderr.seek(0, os.SEEK_END)
        stderr.seek(max(0, stderr.tell() - MESSAGE_CHARS))
        said = " ".join(stderr.read().decode("utf-8", "replace").split())
    if timed_out:
        return {"ok": False, "reason": "time", "message": _seconds(wall)}
    cpu = float(request["cpu_seconds"])
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGXCPU, signal.SIGKILL):
        if usage.ru_utime + usage.ru_stime >= cpu:
            return {"ok": False, "reason": "time", "message": f"{_seconds(cpu)} of CPU"}
        if os.WTERMSIG(status) == signal.SIGKILL:  # not by its limits: the system's out-of-memory killer
            return {"ok": False, "reason": "memory", "message": "it was killed by the system (signal SIGKILL)"}
    if data:
        try:
            answer = json.loads(data)
            if isinstance(answer, dict):
                return answer
        except ValueError:
            pass
    how = (f"signal {signal.Signals(os.WTERMSIG(status)).name}" if os.WIFSIGNALED(status)
           else f"exit status {os.WEXITSTATUS(status)}")
    # a Rust allocation past the heap's limit aborts the process ("memory allocation of N bytes failed")
    reason = "memory" if "memory allocation" in said or "MemoryError" in said else "helper"
    return {"ok": False, "reason": reason, "message": f"it ended by {how}{': ' + said if said else ''}"}


def _child_answer(read: int, wall: float, stdin: int) -> tuple[bytes, bool, bool]:
    """What the child wrote on the pipe ``read`` until it closed it; whether ``wall`` seconds passed first; and
    whether ``stdin`` came to its end first (the serving process sends nothing more while a build runs)."""
    data = bytearray()
    deadline = time.monotonic() + wall
    with os.fdopen(read, "rb", buffering=0) as pipe:
        while True:
            left = deadline - time.monotonic()
            ready = select.select([pipe, stdin], [], [], left)[0] if left > 0 else []
            if not ready:
                return bytes(data), True, False
            if stdin in ready:
                return bytes(data), False, True
            chunk = pipe.read(65536)
            if not chunk:
                return bytes(data), False, False
            data += chunk


def _die_with(parent: int) -> None:
    """This process is killed when ``parent`` ends (Linux's parent-death signal); it ends now if that has
    happened."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def _limit(memory_bytes: int, cpu_seconds: float) -> None:
    """The child's limits: its heap may grow by ``memory_bytes`` (``RLIMIT_DATA``), its CPU time ``cpu_seconds``."""
    try:
        import resource
    except ImportError:  # (Windows) the time limits only: the serving process stops a helper that does not answer
        return
    used = 0
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/self/status") as status:
        for row in status:
            if row.startswith("VmData:"):
                used = int(row.split()[1]) * 1024
    for which, value in ((resource.RLIMIT_DATA, used + memory_bytes), (resource.RLIMIT_CPU, int(cpu_seconds) + 1)):
        _, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(which, (value, hard))


def _build(request: dict[str, Any]) -> dict[str, Any]:
    """Build the tokenizer the request names (and save it where it says): the answer."""
    from transformers import AutoTokenizer

    from asyncinfer.errors import is_native_panic

    try:
        source, gguf_file = request["source"], request.get("gguf_file")
        if gguf_file is not None:
            tokenizer = gguf_only(Path(source) / gguf_file, AutoTokenizer)
        else:
            tokenizer = AutoTokenizer.from_pretrained(source)
        if request.get("save_to"):
            tokenizer.save_pretrained(request["save_to"])
        cls = type(tokenizer)
        return {"ok": True, "tokens": len(tokenizer), "class": f"{cls.__module__}.{cls.__qualname__}"}
    except MemoryError:
        return {"ok": False, "reason": "memory", "message": "MemoryError"}
    except BaseException as exc:  # noqa: BLE001 - a Rust panic is a BaseException
        message = " ".join(str(exc).split())[:MESSAGE_CHARS]
        return {"ok": False, "reason": "panic" if is_native_panic(exc) else "error", "message": message}
