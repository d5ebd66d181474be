"""Reading Hugging Face checkpoint directories: JSON files, safetensors shards, the tokenizer.

Shared by the decoder loader (:mod:`asyncinfer.models.loader`) and the sentence
encoder (:mod:`asyncinfer.models.encoder`). Every failure is a
:class:`~asyncinfer.errors.ModelLoadError` naming the file.
"""

from __future__ import annotations

import base64
import binascii
import functools
import importlib.util
import json
import math
import re
import stat
from collections.abc import Iterator
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from asyncinfer.errors import ModelLoadError, native_panics_as
from asyncinfer.models import tokenizer_build
from asyncinfer.models.hf_imports import transformers_imports

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

SAFETENSORS_WEIGHTS = "model.safetensors"  # transformers' name for an unsharded checkpoint
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
#: Every file of a directory the tokenizer's loader (transformers) may read: each is checked before it runs.
_TOKENIZER_READS = (*TOKENIZER_FILES, "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                    "chat_template.json", "merges.txt", "vocab.txt", "spiece.model", "sentencepiece.bpe.model")
#: The safetensors library's own bound on a file's header bytes.
SAFETENSORS_MAX_HEADER = 100_000_000
#: The most bytes a model's JSON metadata file (config.json, generation_config.json, the safetensors index, the
#: sentence-transformers files) may hold: a thousand times the largest real one.
MAX_JSON_BYTES = 64 * 2**20
#: The most bytes one of its tokenizer's files may hold (the largest real tokenizer.json are some tens of MiB).
MAX_TOKENIZER_FILE_BYTES = 2**30
#: The most a ``tokenizer.json``'s normalizer (or decoder) may multiply a text's characters by, bounded from its
#: ``Replace`` and ``Prepend`` steps (:func:`_check_text_growth`); real tokenizers' bound is 2 at most.
MAX_TEXT_GROWTH = 32


#: The bound :func:`check_file` is given for a file of any size (one whose kind is all it checks).
ANY_SIZE = 2**63 - 1
#: The kernel's pseudo-files, regular files to ``stat`` whose size says nothing of what a read gives (``/proc/kmsg``
#: waits for the kernel's next message): a model file that leads there is refused unread.
_KERNEL_FILES = (Path("/proc"), Path("/sys"))


def check_file(file: Path, limit: int) -> None:
    """Refuse ``file`` unless it is a regular file of at most ``limit`` bytes outside the kernel's pseudo-files
    (``/proc``, ``/sys``), decided from ``stat`` and the resolved path alone (which follow a symbolic link and open
    nothing): a model file that leads to a device (``/dev/zero``) was read until the machine's memory ran out, one
    that is a pipe waited for a writer for ever.

    Raises:
        ModelLoadError: naming the file.
    """
    try:
        info = file.stat()
    except OSError as exc:
        raise ModelLoadError(f"cannot read {file}: {exc}") from exc
    if not stat.S_ISREG(info.st_mode):
        raise ModelLoadError(f"cannot read {file}: it is not a regular file (a device, a pipe or a directory)")
    real = file.resolve()
    if any(real.is_relative_to(root) for root in _KERNEL_FILES):  # sized 0 whatever they hold; some block a read
        raise ModelLoadError(f"cannot read {file}: it is the kernel's file {real}, not a model's")
    if info.st_size > limit:
        raise ModelLoadError(f"cannot read {file}: it holds {info.st_size} bytes, more than a model's file of its "
                             f"kind may ({limit})")


def read_json(file: Path) -> Any:
    """The parsed contents of a JSON file of at most :data:`MAX_JSON_BYTES` (:func:`check_file`).

    Raises:
        ModelLoadError: the file cannot be read, is no regular file, is larger, or is not JSON.
    """
    check_file(file, MAX_JSON_BYTES)
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise ModelLoadError(f"cannot read {file}: {exc}") from exc


#: A model's weight files in PyTorch's pickle format (``torch.save``: transformers' older ``pytorch_model.bin`` and its
#: shards, Meta's ``consolidated.00.pth``), which are never read: a directory holding no safetensors is refused naming
#: them (a training run's ``training_args.bin`` or ``optimizer.pt`` are no weights of the model).
PICKLE_WEIGHTS = ("pytorch_model*.bin", "model*.bin", "model*.pt", "model*.pth", "consolidated*.pth")


def safetensors_files(path: Path) -> list[Path]:
    """The ``*.safetensors`` shards of the directory ``path``, as its index lists them (if it has one); without an
    index, ``model.safetensors`` where there is one (as transformers reads it: another file beside it, a PEFT
    ``adapter_model.safetensors`` or an older copy, is not the model's), else every ``*.safetensors`` file.

    Raises:
        ModelLoadError: an unreadable index, no shard at all, or a listed shard that is missing.
    """
    index = path / "model.safetensors.index.json"
    if index.exists():
        data = read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"cannot read {index}: no 'weight_map' object")
        if not all(isinstance(name, str) for name in weight_map.values()):  # before the set: a list is unhashable
            raise ModelLoadError(f"cannot read {index}: 'weight_map' values must be shard file names (strings)")
        names = set(weight_map.values())
        files = [_shard_in(path, index, name) for name in sorted(names)]
    elif (path / SAFETENSORS_WEIGHTS).exists() or (path / SAFETENSORS_WEIGHTS).is_symlink():
        files = [path / SAFETENSORS_WEIGHTS]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        pickled = sorted({f.name for pattern in PICKLE_WEIGHTS for f in path.glob(pattern)})
        raise ModelLoadError(f"no *.safetensors weights in {path}" + (
            f" ({pickled[0]}{' and more' if len(pickled) > 1 else ''}: PyTorch pickle weights, which asyncinfer does "
            "not read, since loading a pickle can run any code: save the model as safetensors once, as transformers' "
            "save_pretrained writes it)" if pickled else ""))
    for f in files:
        if not f.exists():
            raise ModelLoadError(f"weight shard {f} listed in the index does not exist")
        if not f.is_file():
            raise ModelLoadError(f"weight shard {f} is not a regular file")
        check_file(f, ANY_SIZE)  # any size; not the kernel's files (their headers are read before the map)
    return files


def _shard_in(path: Path, index: Path, name: str) -> Path:
    """The shard the index names, refused unless it is a plain relative name inside the directory.

    Decided from the name alone: nothing outside ``path`` is opened or read (no ``..``, no absolute path,
    no device). A symbolic link inside the directory is the directory owner's own and is followed, as the
    Hugging Face cache lays out a snapshot (``snapshots/REV/NAME -> ../../blobs/HASH``); what it leads to
    must still be a regular file (``safetensors_files`` checks with ``stat``, which opens nothing).

    Raises:
        ModelLoadError: naming the index and the shard name.
    """
    if not name:
        raise ModelLoadError(f"cannot read {index}: weight shard {name!r} is not a file name inside {path} "
                             "(no absolute paths, '..' or devices)")
    return path_inside(path, index, name, "weight shard", "file name")


def path_inside(path: Path, listed_in: Path, name: object, what: str, kind: str = "path") -> Path:
    """``path / name`` for a ``name`` that a file of the model (``listed_in``) gives, refused unless it is a
    relative path inside the directory ``path`` (``""`` is the directory itself): a string without ``..``, a
    NUL, a root or a drive. Decided from the name alone, so nothing outside ``path`` is opened or read.

    Raises:
        ModelLoadError: naming ``listed_in``, ``what`` the name is and the name.
    """
    rel = PurePath(name) if isinstance(name, str) and "\x00" not in name else None
    if rel is None or rel.is_absolute() or rel.drive or ".." in rel.parts:
        raise ModelLoadError(f"cannot read {listed_in}: {what} {name!r} is not a {kind} inside {path} "
                             "(no absolute paths, '..' or devices)")
    return path / rel


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, CPU tensor)`` for every tensor of the shards, one at a time (memory-mapped).

    Raises:
        ModelLoadError: a corrupt or truncated shard, or a tensor that two shards hold (which one is the model's
            cannot be told: the later one silently replaced the earlier).
    """
    from safetensors import safe_open

    held: dict[str, Path] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:  # memory-mapped
                for name in f.keys():  # noqa: SIM118 - a safetensors file handle, not a dict: it has no __iter__
                    if name in held:
                        raise ModelLoadError(f"tensor {name!r} is in two weight files, {held[name].name} and "
                                             f"{file.name} (in {file.parent}): remove the one that is not the "
                                             "model's, or list the shards in model.safetensors.index.json")
                    held[name] = file
                    yield name, f.get_tensor(name)
        except ModelLoadError:
            raise
        except Exception as exc:  # corrupt header, truncated file, ...
            raise ModelLoadError(f"cannot read weights from {file}: {_tensor_at_fault(file) or exc}") from exc


def tensor_names(files: list[Path]) -> Iterator[str]:
    """The names of the shards' tensors, read from their headers alone (no tensor is read).

    Raises:
        ModelLoadError: a corrupt or truncated shard.
    """
    from safetensors import safe_open

    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                names = list(f.keys())
        except Exception as exc:  # corrupt header, truncated file, ...
            raise ModelLoadError(f"cannot read weights from {file}: {_tensor_at_fault(file) or exc}") from exc
        yield from names


def tensor_shape(files: list[Path], name: str) -> list[int] | None:
    """The shape of the shards' tensor ``name``, read from their headers alone; None where none holds it.

    Raises:
        ModelLoadError: a corrupt or truncated shard.
    """
    from safetensors import safe_open

    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                if name in f.keys():  # noqa: SIM118 - a safetensors file handle, not a dict
                    return list(f.get_slice(name).get_shape())
        except Exception as exc:  # corrupt header, truncated file, ...
            raise ModelLoadError(f"cannot read weights from {file}: {_tensor_at_fault(file) or exc}") from exc
    return None


#: Bytes an element of each safetensors dtype takes (the whole-byte ones: a tensor of another dtype is left to the
#: library's own message).
_SAFETENSORS_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E4M3FN": 1, "F8_E8M0": 1,
                            "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "C64": 8, "F64": 8,
                            "I64": 8, "U64": 8}


def _tensor_at_fault(file: Path) -> str | None:
    """Which tensor of a safetensors file the library refused is at fault, read from its header: the first tensor (by
    offset) whose bytes run past the end of the file (a file cut short), said as a GGUF file's is, else the first whose
    shape and dtype need other bytes than its ``data_offsets`` hold; None where the header itself cannot be read or
    no tensor is found at fault (the library's own message then stands). The library says only "incomplete metadata,
    file not fully covered" and "invalid shape, data type, or offset for tensor", naming none."""
    try:
        size = file.stat().st_size
        with file.open("rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if not 0 < length <= min(size - 8, SAFETENSORS_MAX_HEADER):
                return None
            header = json.loads(f.read(length))
        data = size - 8 - length
        spans = sorted((info["data_offsets"][0], info["data_offsets"][1], name, info.get("shape"), info.get("dtype"))
                       for name, info in header.items() if name != "__metadata__" and isinstance(info, dict))
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError):
        return None
    for start, end, name, _shape, _dtype in spans:
        if isinstance(start, int) and isinstance(end, int) and end > data:
            return (f"tensor {name!r} runs past the end of the file ({end - start} bytes at {8 + length + start}, "
                    f"the file has {size}): a truncated file (an interrupted copy or download?)")
    for start, end, name, shape, dtype in spans:
        if (not isinstance(start, int) or not isinstance(end, int) or not isinstance(shape, list)
                or not all(isinstance(d, int) and d >= 0 for d in shape) or dtype not in _SAFETENSORS_DTYPE_BYTES):
            continue
        need = math.prod(shape) * _SAFETENSORS_DTYPE_BYTES[dtype]
        if need != end - start:
            return (f"tensor {name!r} of shape {shape} and dtype {dtype} needs {need} bytes, but its data_offsets "
                    f"[{start}, {end}] hold {end - start}")
    return None


def _has_sentencepiece() -> bool:
    """Whether the sentencepiece package (which transformers needs to read a ``tokenizer.model``) is installed."""
    return importlib.util.find_spec("sentencepiece") is not None


def has_tokenizer_files(path: Path) -> bool:
    """Whether the directory ``path`` holds a tokenizer's files (else it loads without one)."""
    return any((path / name).exists() for name in TOKENIZER_FILES)


def load_hf_tokenizer(path: Path, vocab_size: int | None = None) -> PreTrainedTokenizerBase | None:
    """The tokenizer saved in the directory ``path``; None when it holds no tokenizer files. Every file of the
    directory is checked first (:func:`check_file`); with ``vocab_size`` (the model's embeddings), a tokenizer of
    more tokens is refused before it is built (:func:`_check_vocabulary_fits`); then it is built in a separate
    process bounded in memory and time (:func:`asyncinfer.models.tokenizer_build.check_build`), and here only once
    that build succeeded within the model's vocabulary, both from one private copy of the directory's files
    (:func:`asyncinfer.models.tokenizer_build.private_copy`).

    Raises:
        ModelLoadError: tokenizer files that transformers cannot load, a build past its bounds, or more tokens than
            ``vocab_size``.
    """
    if not has_tokenizer_files(path):
        return None
    reads = _tokenizer_reads(path)
    for file in reads:  # before transformers opens any of them
        check_file(file, MAX_TOKENIZER_FILE_BYTES)
    for entry in path.iterdir():  # transformers looks for more names than these (tekken.json...): none may block
        if entry not in reads:
            _check_not_blocking(entry)
    # Every check below and both builds read one private copy of the files a tokenizer may be built from (a file
    # swapped in the directory between them was built unchecked and unbounded); messages name the directory.
    names = _tokenizer_file_names(path, reads, vocab_size)
    if vocab_size is None:
        limit, said = MAX_TOKENIZER_FILE_BYTES, "the most for a model of unknown vocabulary size"
    else:  # (a sparse file costs nothing where it lies, and was written out whole before its check refused it)
        limit = min(MAX_TOKENIZER_FILE_BYTES, 4 * max(MAX_JSON_BYTES, _token_bytes_bound(vocab_size)))
        said = f"4 times the larger of 64 MiB and 512 bytes a token of the model's vocab_size {vocab_size} and 1 MiB"
    with tokenizer_build.private_copy(path, names, limit, said) as copy:
        try:
            tokenizer = _checked_build(copy, vocab_size, path)
        except ModelLoadError as exc:
            said = str(exc).replace(str(copy.path), str(path))
            if said == str(exc):
                raise
            raise ModelLoadError(said) from exc.__cause__
    tokenizer.name_or_path = str(path)  # (built from the copy, gone now)
    limit = tokenizer.model_max_length  # compared with every encoded text's length by transformers
    if isinstance(limit, bool) or not isinstance(limit, (int, float)):
        raise ModelLoadError(f"cannot load the tokenizer in {path}: its model_max_length is {limit!r}, not a number "
                             f"(tokenizer_config.json)")
    return tokenizer


def _tokenizer_file_names(path: Path, reads: list[Path], vocab_size: int | None) -> list[str]:
    """The names (relative to ``path``) of the files a tokenizer of ``path`` may be built from: those
    :func:`_tokenizer_reads` found, ``config.json``, the fast tokenizer's file ``tokenizer_config.json`` picks, and a
    slow tokenizer's own files (:func:`_vocabulary_files`: the usual names, its class's, and the files transformers
    falls back to: ``tekken.json``, ``tiktoken.model``, ``tokenizer.model.``). What transformers
    would read beyond them is absent from the copy, for both builds alike."""
    config = _JsonFile(path / "tokenizer_config.json")
    limit = max(MAX_JSON_BYTES, _token_bytes_bound(vocab_size)) if vocab_size is not None else MAX_JSON_BYTES
    bound = _token_bytes_bound(vocab_size) if vocab_size is not None else MAX_JSON_BYTES
    names = [str(file.relative_to(path)) for file in reads]
    names += ["config.json", _fast_tokenizer_file(path, config, limit), *_vocabulary_files(path, bound, config)]
    return names


def _checked_build(copy: tokenizer_build.PrivateCopy, vocab_size: int | None, shown: Path) -> PreTrainedTokenizerBase:
    """The checks before the build, the bounded build, then this process's build, all of the private ``copy`` of the
    directory ``shown``'s tokenizer files (see :func:`load_hf_tokenizer`)."""
    path = copy.path
    config = _JsonFile(path / "tokenizer_config.json")  # read once: the fast file's name, the class, special tokens
    # transformers reads tokenizer_config.json whole: within what its token lists may take for this model
    limit = max(MAX_JSON_BYTES, _token_bytes_bound(vocab_size)) if vocab_size is not None else MAX_JSON_BYTES
    fast = _fast_tokenizer_file(path, config, limit)
    tokenizer_json = _JsonFile(path / fast)  # read once, for the three checks below
    if vocab_size is not None:
        _check_vocabulary_fits(path, vocab_size, tokenizer_json, config)
    _check_charsmaps(tokenizer_json)
    _check_text_growth(tokenizer_json)
    # what the checks above cannot foresee is bounded: built first in a separate process, within memory and CPU time
    # in proportion to the model, and its tokens counted, before this process builds it
    if not tokenizer_build.has_verdict(copy, vocab_size):
        tokenizer_build.prepare()  # its helper imports transformers while this process does
    auto = tokenizer_build.auto_tokenizer()
    try:
        tokenizer_build.check_build_once(copy, vocab_size=vocab_size, shown=shown)
    except tokenizer_build.BuildFailed as exc:
        if exc.panicked:
            raise ModelLoadError(f"cannot load the tokenizer in {shown}: the tokenizers library panicked reading "
                                 f"it: {exc.said}") from None
        raise ModelLoadError(f"cannot load the tokenizer in {shown}: {_build_failure(path, exc.said, fast)}") from None
    try:
        with native_panics_as(lambda exc: ModelLoadError(
                f"cannot load the tokenizer in {shown}: the tokenizers library panicked reading it: {exc}")):
            return auto.from_pretrained(path)
    except ModelLoadError:
        raise
    except Exception as exc:
        said = " ".join(str(exc).replace(str(path), str(shown)).split())  # one line, the user's path
        raise ModelLoadError(f"cannot load the tokenizer in {shown}: {_build_failure(path, said, fast)}") from exc


#: The tokenizers library's refusal of a JSON file it reads (serde's words: "data did not match any variant of
#: untagged enum ModelUntagged at line 1 column 5384"), which names no file.
_SERDE_ERROR = re.compile(r" at line \d+ column \d+$")


def _build_failure(path: Path, said: str, fast: str = "tokenizer.json") -> str:
    """Why transformers could not build the tokenizer of ``path`` (its message ``said``; ``fast``: the fast tokenizer's
    file it builds from), with what to do where the directory shows it."""
    vocabulary = ("tokenizer.json", "tokenizer.model", "vocab.json")
    if not any((path / name).exists() for name in vocabulary):
        present = ", ".join(name for name in TOKENIZER_FILES if (path / name).exists())
        # (transformers' own words then advise installing sentencepiece or tiktoken, which would not help)
        return (f"it holds {present} but no vocabulary ({', '.join(vocabulary)}): copy the model's tokenizer "
                "files beside its config.json")
    if _SERDE_ERROR.search(said) and (path / fast).is_file():  # the tokenizers library read the fast file
        return (f"{fast} is not a tokenizer the tokenizers library can read ({said}): copy the model's own tokenizer "
                "files beside its config.json")
    if _JSON_ERROR.search(said):  # Python's JSON error names no file: the one that gives it
        broken = _json_file_at_fault(path, said)
        if broken is not None:
            return f"{broken} is not valid JSON: {said}"
    if (path / "tokenizer.model").exists() and not (path / "tokenizer.json").exists() and not _has_sentencepiece():
        # transformers then tries the file as tiktoken's and says that tiktoken is missing
        return ("its vocabulary is tokenizer.model (SentencePiece's) without a tokenizer.json, which transformers "
                "reads only with the sentencepiece package: pip install sentencepiece, or copy the model's "
                f"tokenizer.json beside its config.json (transformers: {said})")
    return said


_JSON_ERROR = re.compile(r"line \d+ column \d+ \(char \d+\)")


def _json_file_at_fault(path: Path, said: str) -> str | None:
    """The name of the JSON file of ``path`` that Python's reader refuses as ``said`` (else the first it refuses):
    the files transformers reads for a tokenizer first (each checked by :func:`check_file` before the build)."""
    first = ("tokenizer_config.json", "tokenizer.json", "special_tokens_map.json", "added_tokens.json",
             "chat_template.json", "vocab.json", "config.json")
    names = [*first, *sorted(entry.name for entry in path.glob("*.json") if entry.name not in first)]
    refused: list[str] = []
    for name in names:
        file = path / name
        try:
            if not file.is_file() or file.stat().st_size > MAX_TOKENIZER_FILE_BYTES:
                continue
            json.loads(file.read_bytes())
        except ValueError as exc:
            if str(exc) in said:
                return name
            refused.append(name)
        except (OSError, RecursionError):
            continue
    return refused[0] if refused else None


def _fast_tokenizer_file(path: Path, config: _JsonFile, limit: int) -> str:
    """The name of the fast tokenizer's file transformers builds from in ``path``: ``tokenizer.json``, or the one
    ``tokenizer_config.json``'s ``fast_tokenizer_files`` picks for this version of transformers (a
    ``tokenizer.4.0.json`` beside a harmless ``tokenizer.json`` was built unchecked: its charsmap aborted the
    process), ``config`` being its ``tokenizer_config.json``, which transformers reads whole: held to ``limit``
    bytes here (past it the name went unread, and the file it named unchecked). The value is given to transformers'
    own choice as transformers gives it, whatever its type (a JSON object's keys are its names; what the choice
    cannot read fails transformers' load the same way).

    Raises:
        ModelLoadError: a ``tokenizer_config.json`` past ``limit``, or a name that leads out of the directory.
    """
    if config.size is not None and config.size > limit:
        raise ModelLoadError(f"cannot load the tokenizer in {path}: tokenizer_config.json is {config.size} bytes, "
                             f"more than the {limit} that a tokenizer's settings for this model may take")
    value = config.parsed()
    if value is not None and "gguf_file" in value:  # transformers would build the tokenizer from that file, unchecked
        raise ModelLoadError(f"cannot load the tokenizer in {path}: tokenizer_config.json names a gguf_file "
                             f"({value['gguf_file']!r}): load the GGUF file itself as the model, whose tokenizer "
                             "asyncinfer reads from it")
    if value is None or "fast_tokenizer_files" not in value:
        return "tokenizer.json"
    from transformers.tokenization_utils_base import get_fast_tokenizer_file

    try:
        name = get_fast_tokenizer_file(value["fast_tokenizer_files"])
    except Exception:  # noqa: BLE001 - what transformers cannot parse: its own load fails the same way
        return "tokenizer.json"
    if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
        raise ModelLoadError(f"cannot load the tokenizer in {path}: tokenizer_config.json's fast_tokenizer_files "
                             f"picks {name!r}, which is no file of the directory")
    return name


class _JsonFile:
    """One of the tokenizer's JSON files (its ``tokenizer.json``, ``tokenizer_config.json``...) as the checks before
    the build read it: its size from ``stat`` (None where there is no such regular file), its bytes read once, on
    first need, and parsed once with Python's json, as transformers and the tokenizers library read it."""

    def __init__(self, file: Path) -> None:
        self.file = file
        self.size = file.stat().st_size if file.is_file() else None

    @functools.cached_property
    def raw(self) -> bytes | None:
        return self.file.read_bytes() if self.size is not None else None

    def holds(self, marker: bytes) -> bool:
        """Whether its bytes hold ``marker`` (a step's type: only then is it parsed)."""
        return self.raw is not None and marker in self.raw

    @functools.cached_property
    def _value(self) -> Any:
        try:
            return json.loads(self.raw) if self.raw is not None else None
        except (ValueError, RecursionError):
            return None

    def parsed(self) -> dict[str, Any] | None:
        """Its JSON object; None where it is none (the library then refuses it and says why)."""
        return self._value if isinstance(self._value, dict) else None


def _check_not_blocking(entry: Path) -> None:
    """Refuse an entry of a model's directory that a read could block on or never end: a pipe, a device, the
    kernel's files. Anything else is left to whoever reads it (a directory, a socket, a link to nothing: a Hugging
    Face snapshot whose README blob was deleted loads as transformers loads it)."""
    try:
        mode = entry.stat().st_mode
    except OSError:
        return
    if stat.S_ISFIFO(mode) or stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISREG(mode):
        check_file(entry, ANY_SIZE)


def _tokenizer_reads(path: Path) -> list[Path]:
    """The files of the directory ``path`` that transformers may open to build its tokenizer: the known names, and
    the templates of ``additional_chat_templates/`` (each ``*.jinja`` file there is read: one linked to
    ``/proc/kmsg`` hung a load for ever; its other entries are checked as the directory's are). A name that leads
    to nothing (a link to a deleted blob) is no file transformers reads."""
    files = [path / name for name in _TOKENIZER_READS if (path / name).exists()]
    templates = path / "additional_chat_templates"
    if templates.is_dir():
        for entry in sorted(templates.iterdir()):
            if entry.name.endswith(".jinja") and entry.is_file():
                files.append(entry)
            else:
                _check_not_blocking(entry)
    return files


#: The most bytes of JSON a tokenizer's token lists (a ``tokenizer.json``'s vocabulary, merges and added tokens, an
#: ``added_tokens.json``, a ``tokenizer_config.json``'s ``added_tokens_decoder``, a ``vocab.json``) may take for each
#: token the model embeds before their tokens are counted (real files take some 15 to 150 a token).
MAX_VOCAB_BYTES_PER_TOKEN = 512


class _AddedToken(msgspec.Struct):
    content: str


class _TokenizerModel(msgspec.Struct):
    vocab: msgspec.Raw = msgspec.Raw(b"null")
    merges: msgspec.Raw = msgspec.Raw(b"null")


class _TokenizerFile(msgspec.Struct):
    """The parts of a ``tokenizer.json`` that its count of tokens is read from (the rest skipped unread)."""

    added_tokens: msgspec.Raw = msgspec.Raw(b"null")
    model: _TokenizerModel | None = None


#: The token lists of a ``tokenizer_config.json`` (or a ``special_tokens_map.json``) beside its ``*_token`` keys.
_SPECIAL_TOKEN_LISTS = ("added_tokens_decoder", "additional_special_tokens", "extra_special_tokens",
                        "model_specific_special_tokens")


def _token_bytes_bound(vocab_size: int) -> int:
    """The bytes a list of tokens (or a file of them) may take for a model of ``vocab_size`` tokens."""
    return vocab_size * MAX_VOCAB_BYTES_PER_TOKEN + 2**20


def _check_vocabulary_fits(path: Path, vocab_size: int, tokenizer_json: _JsonFile, config: _JsonFile) -> None:
    """Refuse, before the tokenizers library and transformers build it, a tokenizer of more distinct tokens than the
    model embeds, counted over every file transformers merges into its vocabulary (``tokenizer.json``'s vocabulary
    and added tokens, ``added_tokens.json``, ``tokenizer_config.json``'s ``added_tokens_decoder`` and special tokens
    and ``special_tokens_map.json``'s; a slow tokenizer's own files are held each to the model's vocabulary by
    :func:`_check_vocabulary_file`, not merged into the count, as a fast tokenizer never reads them):
    :func:`asyncinfer.loading.check_tokenizer` refuses it once built, but built first, 600,000 added tokens took 25 s
    and 2 GB (each is a Python object in transformers), and a file at the size limit would take some 20 GB. Each
    list is decoded only within :data:`MAX_VOCAB_BYTES_PER_TOKEN` bytes a token (and 1 MiB), so the count's own
    memory stays in proportion to the model.

    Raises:
        ModelLoadError: naming the file and list at fault, or the count and the model's ``vocab_size``.
    """
    bound = _token_bytes_bound(vocab_size)
    lists: list[tuple[str, msgspec.Raw]] = []  # (where, its JSON)
    tokens: set[str] = set()
    counted: list[str] = []  # the files read, for the refusal
    # the fast tokenizer's file (the one transformers builds from), then the two whose special tokens are any key of
    # their own (*_token): read whole
    for doc, fast in ((tokenizer_json, True), (config, False), (_JsonFile(path / "special_tokens_map.json"), False)):
        if doc.size is None:
            continue
        name = doc.file.name
        counted.append(name)
        if not fast:
            tokens |= _tokens_read_as_transformers_does(path, doc, fast, bound, vocab_size)
            continue
        try:
            data = msgspec.json.decode(doc.raw, type=_TokenizerFile)
        except (msgspec.DecodeError, RecursionError):
            # what msgspec refuses, Python's json (transformers') may read (NaN, Infinity, a lone surrogate's
            # escape): read so, the whole file held to the bound, else the count skipped what the build then read
            tokens |= _tokens_read_as_transformers_does(path, doc, fast, bound, vocab_size)
            continue
        model = data.model or _TokenizerModel()
        lists += [(f"{name}'s model.vocab", model.vocab), (f"{name}'s model.merges", model.merges),
                  (f"{name}'s added_tokens", data.added_tokens)]
    if (path / "added_tokens.json").is_file():  # merged into the vocabulary whatever builds it
        _check_list_size(path, "added_tokens.json", (path / "added_tokens.json").stat().st_size, bound, vocab_size)
        lists.append(("added_tokens.json", msgspec.Raw((path / "added_tokens.json").read_bytes())))
        counted.append("added_tokens.json")
    for name in _vocabulary_files(path, bound, config):  # a slow tokenizer's own files, each within the model's vocabulary
        _check_vocabulary_file(path, name, bound, vocab_size)
    for where, raw in lists:
        _check_list_size(path, where, len(raw), bound, vocab_size)
        if not where.endswith("merges"):
            tokens |= _tokens_in(raw)
    if len(tokens) > vocab_size:
        raise ModelLoadError(f"the tokenizer has {len(tokens)} tokens (counted in {', '.join(counted)} of {path}) but "
                             f"the model embeds only {vocab_size}: is it another model's tokenizer? Copy this model's "
                             "own tokenizer files beside its config.json")


#: A SentencePiece model's names in a directory (transformers converts one to its tokenizer where no tokenizer.json is).
_SENTENCEPIECE_FILES = ("tokenizer.model", "spiece.model", "sentencepiece.bpe.model")
#: The files of token lists (or merges) the slow tokenizers of transformers read under their usual names; the class
#: a directory names adds its own (:func:`_vocabulary_files`).
_VOCABULARY_FILES = ("vocab.json", "vocab.txt", "merges.txt", *_SENTENCEPIECE_FILES)
#: The files transformers builds a tokenizer from where the fast tokenizer's file is missing (it searches the directory
#: for these names): Mistral's ``tekken.json``, a ``tiktoken.model``, a ``tokenizer.model`` with dots after its name.
_FALLBACK_VOCABULARY = re.compile(r"tekken\.json|tiktoken\.model|tokenizer\.model\.+")
#: The entries a slow tokenizer's file may hold beyond the model's ``vocab_size`` (a header line, a few specials).
VOCABULARY_FILE_SLACK = 256


def _vocabulary_files(path: Path, bound: int, config: _JsonFile) -> list[str]:
    """The names of the files a slow tokenizer of ``path`` reads its tokens or merges from, present there: the usual
    names, and those the tokenizer's class declares (``vocab_files_names``: ProphetNet's ``prophetnet.tokenizer``,
    PhoBERT's ``bpe.codes``...), the class transformers picks: ``tokenizer_config.json``'s ``tokenizer_class``, else
    ``config.json``'s, else the tokenizer of ``config.json``'s ``model_type``."""
    names = list(_VOCABULARY_FILES)
    found = _tokenizer_class(path, bound, config)
    if found is not None:
        names += [name for name in found.vocab_files_names.values()
                  if isinstance(name, str) and name != "tokenizer.json" and name not in names]
    names += sorted(entry.name for entry in path.iterdir()
                    if _FALLBACK_VOCABULARY.fullmatch(entry.name) and entry.name not in names)
    return [name for name in names if "/" not in name and (path / name).is_file()]


def _tokenizer_class(path: Path, bound: int, config: _JsonFile) -> Any:
    """The tokenizer class transformers would build for ``path`` (None where none is named or known), from its
    ``tokenizer_config.json`` (``config``, within ``bound`` bytes) and its ``config.json`` (within
    :data:`MAX_JSON_BYTES`, as its loader reads it), both read with Python's json, as transformers reads them
    (msgspec refuses a NaN that json takes)."""
    with transformers_imports():
        from transformers import PreTrainedTokenizerBase
        from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    def within(doc: _JsonFile, limit: int) -> dict[str, Any]:  # past its bound, refused where it is read
        return (doc.parsed() if doc.size is not None and doc.size <= limit else None) or {}

    tokenizer_config = within(config, bound)
    model_config = within(_JsonFile(path / "config.json"), MAX_JSON_BYTES)
    model_type = model_config.get("model_type")
    mapped = TOKENIZER_MAPPING_NAMES.get(model_type) if isinstance(model_type, str) else None
    for name in (tokenizer_config.get("tokenizer_class"), model_config.get("tokenizer_class"),
                 mapped[0] if isinstance(mapped, tuple) else mapped):
        if not isinstance(name, str) or not name:
            continue
        try:
            found = tokenizer_class_from_name(name) or tokenizer_class_from_name(name.removesuffix("Fast"))
        except Exception:  # noqa: BLE001 - a name transformers cannot import (a missing optional package): its own load says so
            found = None
        if isinstance(found, type) and issubclass(found, PreTrainedTokenizerBase):  # not AutoModel, AutoConfig...
            return found
    return None


def _check_vocabulary_file(path: Path, name: str, bound: int, vocab_size: int) -> None:
    """Refuse a slow tokenizer's file of more entries than the model embeds (and :data:`VOCABULARY_FILE_SLACK`)
    before a tokenizer reads it: its bytes first (:data:`MAX_VOCAB_BYTES_PER_TOKEN` a token), then its entries, a
    JSON file's tokens, a SentencePiece model's pieces, else a text file's lines (a token or a merge a line). A
    ``vocab.txt`` of 6,000,000 lines, a ``merges.txt`` (or PhoBERT's ``bpe.codes``) of 5,000,000, a
    ``prophetnet.tokenizer`` of 3,000,000 were built in full; a tokenizer.json beside them does not keep the slow
    classes (BertJapanese's) from reading them.

    Raises:
        ModelLoadError: naming the file and its entries.
    """
    file = path / name
    _check_list_size(path, name, file.stat().st_size, bound, vocab_size)
    raw = file.read_bytes()
    limit = vocab_size + VOCABULARY_FILE_SLACK
    squares = 0  # the work of deriving merges from the file (MERGE_SPLIT_WORK), where a converter derives them
    if name == "tekken.json":
        entries, squares = _tekken_vocabulary(raw)
        kind = "tokens (its vocabulary and special tokens)"
    elif name.endswith(".json"):
        entries, kind = len(_tokens_in(raw)), "tokens"
    else:
        entries, kind = _lines_in(raw), "lines"
        if name.endswith(".model"):  # read as both readers may: SentencePiece's pieces, tiktoken's lines
            try:
                walked = _sentencepiece_pieces(raw, stop=limit + 1)
            except _FieldsPastModel as past:
                raise ModelLoadError(f"cannot load the tokenizer in {path}: {name} holds more than {past.args[0] - 1} "
                                     "fields, more than a SentencePiece model of the model's vocab_size has") from None
            lines, squares = _tiktoken_lines(raw)
            for blob in walked.charsmaps if walked else ():  # an empty one is the identity: none to read
                if blob:
                    _check_charsmap(file, blob)
            if walked and walked[0]:  # the more of the two readings, each for both measures
                entries, kind = max((walked[0], "SentencePiece pieces"), (lines, "lines of a token and its rank"))
                squares = max(squares, walked[1])
    if entries > limit:
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {name} holds {entries} {kind}, more than the "
                             f"model's vocab_size {vocab_size} (and {VOCABULARY_FILE_SLACK} more, for a header and "
                             "special tokens) allows: is it another model's? Copy this model's own tokenizer files, "
                             "or remove it")
    _check_split_work(path, name, squares, vocab_size)


def _check_split_work(path: Path, where: str, squares: int, vocab_size: int) -> None:
    """Refuse a vocabulary (named by ``where``) whose tokens' squared byte lengths sum to more than
    :data:`MERGE_SPLIT_WORK` a token of the model's."""
    if squares > vocab_size * MERGE_SPLIT_WORK:
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {where}'s tokens' byte lengths, squared, sum to "
                             f"{squares}, more than {vocab_size * MERGE_SPLIT_WORK} ({MERGE_SPLIT_WORK} a token of the "
                             f"model's vocab_size {vocab_size}): transformers derives a tokenizer's merges from such a "
                             "vocabulary by splitting every token at every byte")


#: The merges of a tekken.json, a SentencePiece model, a tiktoken file or a ``vocab`` given in tokenizer_config.json
#: are derived from its vocabulary, each token split at every byte, so their time and memory grow with the squares of
#: the tokens' lengths (the tokens a, aa, ... up to 1,200 a's, a file of 1 MB, took 35 s and 3 GiB as a tekken.json,
#: 48 s and 2.4 GB as a tiktoken.model): the sum of those squares (a SentencePiece piece's: its whole entry's, a few
#: bytes more than its text) is held to this much a token of the model's vocabulary (a real vocabulary's comes to
#: some hundreds a token at most).
MERGE_SPLIT_WORK = 1024


def _tiktoken_lines(raw: bytes) -> tuple[int, int]:
    """The lines of ``raw`` tiktoken's reader takes as a token (base64) and its rank (two words), and the sum of the
    squares of those tokens' byte lengths."""
    lines = squares = 0
    for line in raw.splitlines():
        words = line.split()
        if len(words) == 2:
            lines += 1
            squares += (len(words[0]) * 3 // 4) ** 2  # base64: 4 characters, 3 bytes
    return lines, squares


def _tekken_vocabulary(raw: bytes) -> tuple[int, int]:
    """The tokens transformers builds from a Mistral ``tekken.json`` (its ``MistralConverter``): the special tokens,
    padded with fillers to the config's ``default_num_special_tokens`` (a number, not a list: a file of 10 KB
    declared a million), and the vocabulary, cut to the config's ``default_vocab_size`` less them; and the sum of the
    squares of the kept tokens' byte lengths (the work of deriving their merges). What the converter cannot read
    counts nothing: its own build then fails before it makes a token."""
    try:
        data = json.loads(raw)
        config, vocab = data["config"], data["vocab"]
        specials = len(data.get("special_tokens") or [])
        declared = config.get("default_num_special_tokens")
        num_special = declared if isinstance(declared, int) and not isinstance(declared, bool) else specials
        size = config.get("default_vocab_size")
        kept = vocab if size is None else vocab[:size - num_special] if isinstance(size, int) else []
        squares = sum((len(entry["token_bytes"]) * 3 // 4) ** 2 for entry in kept  # base64: 4 characters, 3 bytes
                      if isinstance(entry, dict) and isinstance(entry.get("token_bytes"), str))
        return len(kept) + max(specials, num_special), squares
    except (ValueError, RecursionError, TypeError, KeyError, AttributeError):
        return 0, 0


#: What ends a line for ``str.splitlines`` (which some slow tokenizers read their files with: ESM's), a superset of
#: what text mode's ``readlines`` ends one at (``\n``, ``\r\n``, a lone ``\r``).
_LINE_ENDS = ("\n", "\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029")


def _lines_in(raw: bytes) -> int:
    """The lines of a text file as the readers that split it most read it (``str.splitlines``), counted without
    making them: a file of 250,000 tokens split by ``\x1c`` counted one line and was built in full."""
    text = raw.decode("utf-8", errors="replace")
    ends = sum(text.count(end) for end in _LINE_ENDS) - text.count("\r\n")
    return ends + (bool(text) and not text.endswith(_LINE_ENDS))


def _varint(raw: bytes, at: int) -> tuple[int, int] | None:
    """The protocol buffers varint at ``at`` and the offset after it; None where ``raw`` ends within it."""
    value = shift = 0
    while at < len(raw) and shift < 64:
        byte = raw[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if byte < 0x80:
            return value, at
        shift += 7
    return None


#: The fields a SentencePiece model may hold beside its pieces (its specs, their groups) before the walk gives up.
_MORE_FIELDS = 4096


class _FieldsPastModel(ValueError):
    """A SentencePiece model's walk met more fields than a model of the pieces it may hold has."""


class _PieceWalk(NamedTuple):
    """What :func:`_sentencepiece_pieces` read of a SentencePiece model."""

    pieces: int
    squares: int  # the sum of the squares of the pieces' entries' lengths (MERGE_SPLIT_WORK)
    charsmaps: tuple[bytes, ...] = ()  # its normalizer's and denormalizer's precompiled_charsmap, each as written


def _proto_fields(raw: bytes, at: int, end: int) -> Iterator[tuple[int, int, int] | None]:
    """The fields of the protocol buffers message in ``raw[at:end]``, in order: (its number, the start and end of its
    payload) for a length-delimited field, (its number, -1, -1) for another (a group's start and end are fields of no
    payload, their fields read as they come); None, and no more, where the bytes end within a field or use no wire
    type."""
    while at < end:
        key = _varint(raw, at)
        if key is None:
            yield None
            return
        tag, at = key
        wire, start, stop = tag & 7, -1, -1
        if wire == 0:
            skipped = _varint(raw, at)
            if skipped is None:
                yield None
                return
            at = skipped[1]
        elif wire in (1, 5):
            at += 8 if wire == 1 else 4
        elif wire == 2:
            length = _varint(raw, at)
            if length is None:
                yield None
                return
            start, at = length[1], length[1] + length[0]
            stop = at
        elif wire not in (3, 4):  # no wire type at all
            yield None
            return
        if at > end:
            yield None
            return
        yield tag >> 3, start, stop


def _sentencepiece_pieces(raw: bytes, stop: int) -> _PieceWalk | None:
    """How many pieces a SentencePiece model (a ``ModelProto`` message, whose field 1 repeats its pieces) holds,
    counted up to ``stop``, and the sum of the squares of their entries' lengths, each a bound on its text's (a
    piece whose text field was written twice, short then long, is read with the last: :data:`MERGE_SPLIT_WORK`);
    its normalizer's and denormalizer's (fields 3 and 5) precompiled charsmaps (their field 2). None where ``raw``
    ends within a field or uses no wire type (tiktoken's ``tokenizer.model`` is text, which the library reads so:
    such text comes out as None or a count of few pieces). Raises :class:`_FieldsPastModel` past ``stop`` and
    :data:`_MORE_FIELDS` fields, which no model of ``stop`` pieces holds (16 MB of one-byte groups took 8 s to walk;
    40,000 unknown fields before a model's pieces hid them, and their merges aborted the process)."""
    pieces = squares = fields = 0
    charsmaps: list[bytes] = []

    def counted(walk: Iterator[tuple[int, int, int] | None]) -> Iterator[tuple[int, int, int] | None]:
        nonlocal fields
        for field in walk:
            fields += 1  # a spec's fields too: the walk is bounded whatever holds them
            if fields > stop + _MORE_FIELDS:  # a real model's fields are its pieces and a few more: no model's
                raise _FieldsPastModel(fields)
            yield field

    for field in counted(_proto_fields(raw, 0, len(raw))):
        if field is None:
            return None
        number, start, end = field
        if number == 1 and start >= 0:
            pieces += 1
            squares += (end - start) ** 2  # bounds its text, whichever of its fields the library keeps
            if pieces >= stop:
                break
        elif number in (3, 5) and start >= 0:
            for spec in counted(_proto_fields(raw, start, end)):
                if spec is None:
                    break
                if spec[0] == 2 and spec[1] >= 0:
                    charsmaps.append(raw[spec[1]:spec[2]])
    return _PieceWalk(pieces, squares, tuple(charsmaps))


def _check_list_size(path: Path, where: str, size: int, bound: int, vocab_size: int) -> None:
    if size > bound:
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {where} takes {size} bytes, more than {bound} "
                             f"({MAX_VOCAB_BYTES_PER_TOKEN} a token of the model's vocab_size {vocab_size}, and 1 MiB)")


def _tokens_read_as_transformers_does(path: Path, doc: _JsonFile, fast: bool, bound: int, vocab_size: int) -> set[str]:
    """The tokens of a file read with Python's json as transformers reads it (none where that refuses it too: the
    library then says what), the whole file held to ``bound``: a ``tokenizer.json`` msgspec refused, and every
    ``tokenizer_config.json`` and ``special_tokens_map.json``, whose special tokens are its lists and any key of its
    own named ``*_token`` (and ``model_specific_special_tokens``'s): 50,000 such keys were built, in 20 s, before
    their count was refused."""
    _check_list_size(path, doc.file.name, doc.size or 0, bound, vocab_size)
    value = doc.parsed()
    if value is None:
        return set()
    parts: list[Any] = [value.get(part) for part in _SPECIAL_TOKEN_LISTS]
    parts.append([item for key, item in value.items() if key.endswith("_token")])
    decoder = value.get("added_tokens_decoder")
    if not fast and isinstance(decoder, dict):  # {id: token}: a tiktoken file's conversion fills every id up to the last
        past = [key for key in decoder
                if not (key.isascii() and key.lstrip("-").isdigit()) or not 0 <= int(key) < vocab_size]
        if past:
            raise ModelLoadError(f"cannot load the tokenizer in {path}: {doc.file.name}'s added_tokens_decoder holds "
                                 f"the id {past[0]!r}, not one of the model's 0..{vocab_size - 1} (the tokenizer would "
                                 "make tokens up to it)")
    if not fast and "vocab" in value:  # given to the tokenizer's class, which derives merges from it where none are
        given = value["vocab"]  # {token: anything}, whose keys are split for merges, or [token or [token, score]]
        vocab = set(given) if isinstance(given, dict) else _tokens_of(given)
        _check_split_work(path, f"{doc.file.name}'s vocab", sum(len(t.encode()) ** 2 for t in vocab), vocab_size)
        parts.append(list(vocab))
    if fast:
        model = value.get("model")
        parts = [value.get("added_tokens"), model.get("vocab") if isinstance(model, dict) else None]
    return set().union(*(_tokens_of(part) for part in parts))


def _tokens_in(raw: msgspec.Raw | bytes) -> set[str]:
    """:func:`_tokens_of` a JSON token list (read as transformers reads it where msgspec refuses it)."""
    try:
        value = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        try:
            value = json.loads(bytes(raw))
        except (ValueError, RecursionError):
            return set()
    return _tokens_of(value)


def _tokens_of(value: Any) -> set[str]:
    """The tokens a token list names: ``{token: id}`` (a vocabulary, ``added_tokens.json``), ``{id: {"content":
    token}}`` (``added_tokens_decoder``), ``[{"content": token}]`` (added tokens), ``[[token, score]]`` (Unigram),
    ``[token]`` or ``{name: token}`` (special tokens); none for anything else (the library refuses it)."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    tokens = set()
    for key, item in items:
        if isinstance(item, str):
            tokens.add(item)
        elif isinstance(item, dict):
            content = item.get("content")
            if isinstance(content, str):
                tokens.add(content)
        elif isinstance(item, list) and item and isinstance(item[0], str):
            tokens.add(item[0])
        elif isinstance(key, str):
            tokens.add(key)
    return tokens


def _check_text_growth(tokenizer_json: _JsonFile) -> None:
    """Refuse a ``tokenizer.json`` whose normalizer or decoder can multiply a text's characters by more than
    :data:`MAX_TEXT_GROWTH`, before the tokenizers library reads it. Its ``Replace`` steps put their ``content``
    for each match of their pattern (a regular expression's match can be one character, or none: a bound of
    ``len(content) + 1`` a character; a plain string's ``len(content) / len(pattern)``), ``Prepend`` its text
    before each piece, and a ``Sequence`` multiplies its steps' growths: three steps that wrote 1,000 ``a`` for
    each ``a`` made a chat's ``assistant`` a text of 10**9 characters, and the process aborted asking for 4 GiB
    (every text of up to ``OFF_LOOP_CHARS`` characters is tokenized on the event loop, too).

    Raises:
        ModelLoadError: naming the file and the step.
    """
    if not tokenizer_json.holds(b'"Replace"') and not tokenizer_json.holds(b'"Prepend"'):
        return
    data = tokenizer_json.parsed()
    if data is None:  # not a JSON object: the library refuses it
        return
    file = tokenizer_json.file
    for part in ("normalizer", "decoder"):
        growth, stack = 1, [data.get(part)]
        while stack:
            value = stack.pop()
            if isinstance(value, list):
                stack.extend(value)
            elif isinstance(value, dict):
                stack.extend(value.values())
                step = _step_growth(value)
                growth *= step
                if growth > MAX_TEXT_GROWTH:
                    raise ModelLoadError(
                        f"cannot load the tokenizer in {file.parent}: {file.name}'s {part} can multiply a text's "
                        f"characters by more than {MAX_TEXT_GROWTH} (its {value.get('type')} step alone by up to "
                        f"{step}): every prompt would be tokenized at that size")


def _step_growth(step: dict[str, Any]) -> int:
    """The most one ``Replace`` or ``Prepend`` step of a tokenizer.json multiplies a text's characters by (1 for
    any other step, and for values the library refuses anyway)."""
    kind = step.get("type")
    if kind == "Prepend" and isinstance(step.get("prepend"), str):
        return 1 + len(step["prepend"])  # a piece of one character gains the whole prefix
    content, pattern = step.get("content"), step.get("pattern")
    if kind != "Replace" or not isinstance(content, str) or not isinstance(pattern, dict):
        return 1
    string = pattern.get("String")
    if isinstance(string, str) and string:
        return max(1, -(-len(content) // len(string)))
    return 1 + len(content)  # a regular expression: a match of one character, or an empty one before each


def _check_charsmap(file: Path, blob: bytes) -> None:
    """Refuse a ``precompiled_charsmap`` (of ``file``) that declares a trie larger than it holds (:func:`_check_charsmaps`)."""
    declared = int.from_bytes(blob[:4], "little") if len(blob) >= 4 else None
    if declared is None or declared > len(blob) - 4:
        raise ModelLoadError(f"cannot load the tokenizer in {file.parent}: {file.name}'s Precompiled normalizer has a "
                             f"precompiled_charsmap of {len(blob)} bytes that declares a trie of {declared} bytes")


def _check_charsmaps(tokenizer_json: _JsonFile) -> None:
    """Refuse a ``tokenizer.json`` whose ``Precompiled`` normalizer's ``precompiled_charsmap`` declares a trie
    larger than the charsmap holds, before the tokenizers library reads it: it allocates what the first 4 bytes
    declare (``/////w==``: 0xFFFFFFFF, 8 GiB asked and the process aborted, one model directory taking down the
    server that loads or swaps to it).

    Raises:
        ModelLoadError: naming the file.
    """
    data = tokenizer_json.parsed() if tokenizer_json.holds(b'"Precompiled"') else None
    if data is None:  # none, or not a JSON object: the library refuses it
        return
    file = tokenizer_json.file
    stack: list[Any] = [data]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            charsmap = value.get("precompiled_charsmap")
            if value.get("type") == "Precompiled" and isinstance(charsmap, str):
                try:
                    blob = base64.b64decode(charsmap)
                except (ValueError, binascii.Error):
                    blob = b""
                _check_charsmap(file, blob)
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
