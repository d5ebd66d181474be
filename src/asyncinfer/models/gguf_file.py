"""A GGUF file read once: header, metadata and tensor index in one pass, tensors dequantised in torch.

``gguf.GGUFReader`` builds a numpy view per field part (about 300 000 of them for a
49k-token vocabulary), which took ~13 s per parse of SmolLM2-135M on a 2-core CPU;
this reader walks the same bytes with ``struct`` and takes ~0.1 s. The format
(https://github.com/ggml-org/ggml/blob/master/docs/gguf.md), little-endian only:

    magic "GGUF", version (u32), tensor count (u64), metadata count (u64),
    metadata: key (string), value type (u32), value,
    tensor infos: name (string), n_dims (u32), dims (u64 each, fastest first), type (u32), offset (u64),
    padding to ``general.alignment`` (default 32), then the tensor data.

The whole index is checked against the file's size before anything is allocated (counts that
the bytes cannot hold, more than 4 dimensions, rows that are not whole blocks, offsets that are not
aligned or run past the end, an alignment that is not a power of two, arrays nested past
``_MAX_DEPTH``, metadata arrays of more than :data:`MAX_METADATA_ITEMS` items in all): every such file is a
:class:`~asyncinfer.errors.ModelLoadError` naming the tensor or
key, in microseconds per entry.

The file is mapped copy-on-write (``MAP_PRIVATE``): a tensor can be used in place as a view
(:meth:`GGUFFile.view`, :meth:`GGUFFile.blocks`) and nothing written to one ever reaches the file or
faults. :meth:`GGUFFile.release` drops a tensor's pages from the process once it has been copied
elsewhere (repacked into a kernel's layout, converted to another dtype), so a load holds each byte
of the file once at most.

Q4_0, Q4_1 and Q8_0 are dequantised with whole-tensor numpy ops, bit-identical to
``gguf.quants`` (the same float32 multiply, then add) but without its per-16-row
Python loop; other quantised types go through ``gguf.quants.dequantize``. Numpy,
not torch: torch's intra-op threads spin-wait, and on a busy 2-core machine that
turned 0.6 s of dequantisation into 26 s, while numpy's single thread never waits.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncinfer.errors import ModelLoadError
from asyncinfer.kernels.formats import READ_LAYOUTS

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)  # the versions whose header layout this reader parses (llama.cpp writes 3)
_DEFAULT_ALIGNMENT = 32

# Metadata value types: struct format of the scalar ones; 8 = string, 9 = array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_MAX_DEPTH = 4  # arrays of arrays: deeper nesting is refused (ggml writes one level)
#: Items of the metadata's arrays, all together (a file's vocabulary, scores, token types and merges: about 800,000
#: in the largest real files). Each item becomes a Python object as the header is read, 8 to 9 bytes of memory a byte
#: of a one-byte array, so a count past this is refused, naming the key, before the array is read.
MAX_METADATA_ITEMS = 1 << 23
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_DIM = 2**63 - 1  # a dimension's size: ggml's int64_t ne[] (and torch's)
_MIN_FIELD_BYTES = 8 + 4 + 1  # key length, value type, the smallest value
_MIN_TENSOR_BYTES = 8 + 4 + 4 + 8  # name length, dimension count, type, offset (no dimension at all)
_MIN_ITEM_BYTES = {_STRING: 8, **{kind: struct.calcsize(fmt) for kind, fmt in _SCALARS.items()}, _ARRAY: 12}

# ggml tensor types: (elements per block, bytes per block). The block formats' layouts are
# asyncinfer.kernels.formats' (READ_LAYOUTS).
_F32, _F16, _Q4_0, _Q4_1, _Q8_0, _BF16 = 0, 1, 2, 3, 8, 30
_LAYOUTS = {_Q4_0: READ_LAYOUTS["q4_0"], _Q4_1: READ_LAYOUTS["q4_1"], _Q8_0: READ_LAYOUTS["q8_0"]}
_BLOCKS = {_F32: (1, 4), _F16: (1, 2), _BF16: (1, 2),
           **{kind: (layout.weights, layout.nbytes) for kind, layout in _LAYOUTS.items()}}

# Every ggml tensor type a GGUF file may name: id -> (name, elements per block, bytes per block), as ggml
# defines them (ggml.h's ggml_type, ggml.c's type traits). Held here so that parsing a header never imports
# the ``gguf`` package (~0.5 s of CPU, most of a header's parse); tests/models/test_gguf_file.py checks the
# table against gguf.constants. An id missing here is looked up there (a type newer than this table).
_GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the index: ``shape`` slowest-first (torch order), ``offset`` absolute in the file."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        """ggml's name of the tensor's type ("Q4_K", "F16", ...)."""
        return _type_name(self.ggml_type)

    @property
    def format(self) -> str:
        """The tensor's format as the weight formats name it: "float32", "float16", "bfloat16", or ggml's
        block type in lower case ("q4_1", "q8_0", "q4_k", ...: a block format of
        :data:`asyncinfer.kernels.formats.LAYOUTS` where a kernel takes it)."""
        return tensor_format(self.ggml_type)

    @property
    def rows(self) -> int:
        """Rows of the tensor as a matrix (every dimension but the fastest)."""
        return math.prod(self.shape[:-1]) if self.shape else 1


_FLOAT_NAMES = {_F32: "float32", _F16: "float16", _BF16: "bfloat16"}
_FLOAT_DTYPES = {_F32: torch.float32, _F16: torch.float16, _BF16: torch.bfloat16}


def tensor_format(ggml_type: int) -> str:
    """The name of a ggml tensor type as :attr:`GGUFTensor.format` spells it."""
    if ggml_type in _FLOAT_NAMES:
        return _FLOAT_NAMES[ggml_type]
    name = _type_name(ggml_type)
    return name if name.startswith("ggml type") else name.lower()


def _type_name(ggml_type: int) -> str:
    """ggml's name of a tensor type, from :data:`_GGML_TYPES` (gguf.constants for an id missing there)."""
    if ggml_type in _GGML_TYPES:
        return _GGML_TYPES[ggml_type][0]
    try:
        from gguf.constants import GGMLQuantizationType

        return GGMLQuantizationType(ggml_type).name
    except (ImportError, ValueError):
        return f"ggml type {ggml_type}"


class GGUFFile:
    """The parsed header of a ``.gguf`` file; tensors are read from a memory map on demand.

    ``fields``: metadata key -> value (ints, floats, bools, strings, lists).
    ``tensors``: the tensor index, in file order.

    Raises:
        ModelLoadError: not a GGUF file, a big-endian, truncated or corrupt one (naming the tensor or
            key where one is at fault), decided from the header alone.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as fh:
                # Copy-on-write: tensors used in place as views can never write to (or fault on) the file.
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError, OverflowError) as exc:
            raise ModelLoadError(f"cannot read GGUF file {self.path}: {exc}") from exc
        try:
            self.fields, self.tensors = self._parse(memoryview(self._map))
        except (struct.error, UnicodeDecodeError, IndexError, ValueError, OverflowError, MemoryError) as exc:
            raise ModelLoadError(f"cannot read GGUF file {self.path}: truncated or corrupt header ({exc})") from exc

    # ------------------------------------------------------------------ parsing
    def _parse(self, buf: memoryview) -> tuple[dict[str, Any], list[GGUFTensor]]:
        if bytes(buf[:4]) != _MAGIC:
            raise ModelLoadError(f"cannot read GGUF file {self.path}: not a GGUF file (bad magic)")
        version, n_tensors, n_fields = struct.unpack_from("<IQQ", buf, 4)
        if version > 0xFFFF:
            raise ModelLoadError(f"cannot read GGUF file {self.path}: big-endian GGUF files are not supported")
        if version not in _VERSIONS:
            # Another version lays its header out otherwise (v1's 32-bit counts; a later one's unknown): its
            # fields, read as v3's, would be garbage, so it is refused here, as llama.cpp refuses it.
            raise ModelLoadError(f"cannot read GGUF file {self.path}: GGUF version {version} is not supported "
                                 f"(this reader reads versions {' and '.join(map(str, _VERSIONS))})")
        for what, count, least in (("tensor count", n_tensors, _MIN_TENSOR_BYTES),
                                   ("metadata count", n_fields, _MIN_FIELD_BYTES)):
            if count * least > len(buf):
                raise ModelLoadError(f"cannot read GGUF file {self.path}: its header's {what} {count} needs at "
                                     f"least {count * least} bytes, but the file has {len(buf)} (truncated or "
                                     "corrupt)")
        pos = 24
        fields: dict[str, Any] = {}
        items_left = [MAX_METADATA_ITEMS]
        for _ in range(n_fields):
            key, pos = _string(buf, pos)
            (vtype,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            try:
                fields[key], pos = _value(buf, pos, vtype, 0, items_left)
            except (struct.error, ValueError) as exc:
                raise ModelLoadError(f"cannot read GGUF file {self.path}: metadata {key!r}: {exc}") from exc
        infos = []
        names: set[str] = set()
        for _ in range(n_tensors):
            name, pos = _string(buf, pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            if n_dims > _MAX_DIMS:
                raise ModelLoadError(f"cannot read GGUF file {self.path}: tensor {name!r} has {n_dims} dimensions "
                                     f"(at most {_MAX_DIMS})")
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            if any(d > _MAX_DIM for d in dims):  # beside a 0, a size no file holds passes the bytes' check below
                raise ModelLoadError(f"cannot read GGUF file {self.path}: tensor {name!r} has a dimension of "
                                     f"{max(dims)} (at most {_MAX_DIM}, ggml's int64 sizes)")
            if name in names:
                raise ModelLoadError(f"cannot read GGUF file {self.path}: tensor {name!r} appears twice")
            names.add(name)
            infos.append((name, dims, ggml_type, offset))
        self.header_end = pos  # the metadata and the tensor index end here (header_digest)
        alignment = fields.get("general.alignment", _DEFAULT_ALIGNMENT)
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 or alignment & (
                alignment - 1):
            raise ModelLoadError(f"cannot read GGUF file {self.path}: metadata 'general.alignment' = {alignment!r} "
                                 "is not a positive power of two")
        data_start = -(-pos // alignment) * alignment
        tensors = []
        for name, dims, ggml_type, offset in infos:
            block, size = _block(ggml_type, name)
            row = dims[0] if dims else 1  # a tensor of no dimension holds one value (its bytes were counted as none)
            if row % block:
                raise ModelLoadError(f"cannot read GGUF file {self.path}: tensor {name!r} ({tensor_format(ggml_type)}) "
                                     f"has rows of {row} values, not a whole number of {block}-value blocks")
            nbytes = math.prod(dims) // block * size  # Python ints: no overflow, however large the counts
            start = data_start + offset
            if offset % alignment:
                raise ModelLoadError(f"cannot read GGUF file {self.path}: tensor {name!r} starts at offset {offset}, "
                                     f"not a multiple of the file's alignment {alignment}")
            if start + nbytes > len(buf):
                raise ModelLoadError(
                    f"cannot read GGUF file {self.path}: tensor {name!r} runs past the end of the file "
                    f"({nbytes} bytes at {start}, the file has {len(buf)})"
                )
            tensors.append(GGUFTensor(name, tuple(int(d) for d in reversed(dims)), ggml_type, start, nbytes))
        return fields, tensors

    def header_digest(self) -> str:
        """A digest of the header's bytes (metadata and tensor index): what a cache built from the metadata (the
        tokenizer) is stamped with, as a file rewritten with other metadata at the same size and time differs."""
        return hashlib.blake2b(self._map[: self.header_end], digest_size=16).hexdigest()

    # ------------------------------------------------------------------ tensors
    def raw(self, tensor: GGUFTensor) -> np.ndarray:
        """The tensor's bytes: a ``uint8`` view of the (copy-on-write) memory map."""
        return np.frombuffer(self._map, dtype=np.uint8, count=tensor.nbytes, offset=tensor.offset)

    def blocks(self, tensor: GGUFTensor) -> torch.Tensor:
        """The tensor's bytes as rows: a ``uint8 [rows, bytes per row]`` view of the map (ggml's block
        layout for a block type), no copy."""
        return torch.from_numpy(self.raw(tensor)).view(tensor.rows, -1 if tensor.rows else 0)

    def view(self, tensor: GGUFTensor) -> torch.Tensor:
        """A float tensor (F32, F16, BF16) in its own dtype and ``tensor.shape``, as a view of the map (no copy).

        Raises:
            ModelLoadError: the tensor is in a block format (use :meth:`dequantize`).
        """
        if tensor.ggml_type not in _FLOAT_DTYPES:
            raise ModelLoadError(f"GGUF tensor {tensor.name!r} is {tensor.type_name}, not a float type")
        return torch.from_numpy(self.raw(tensor)).view(_FLOAT_DTYPES[tensor.ggml_type]).view(tensor.shape)

    def release(self, tensor: GGUFTensor) -> None:
        """Drop the pages that hold only this tensor from the process (``MADV_DONTNEED``) once its values
        have been copied elsewhere: they stop counting in its resident memory (the kernel's page cache keeps
        them). Pages shared with a neighbouring tensor are kept. A view of the tensor stays valid (its pages are
        read back from the file when touched again); only what was written into it would be lost."""
        page = mmap.PAGESIZE
        start = -(-tensor.offset // page) * page
        end = (tensor.offset + tensor.nbytes) // page * page
        if end > start and hasattr(self._map, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def dequantize(self, tensor: GGUFTensor) -> torch.Tensor:
        """The tensor as a new float32 CPU tensor of ``tensor.shape`` (never a view of the file)."""
        raw = self.raw(tensor)
        kind = tensor.ggml_type
        if kind == _F32:
            array = raw.view(np.float32).copy()
        elif kind == _F16:
            array = raw.view(np.float16).astype(np.float32)
        elif kind == _BF16:
            array = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif kind in (_Q4_0, _Q4_1, _Q8_0):
            array = _dequantize_blocks(raw.reshape(-1, _BLOCKS[kind][1]), kind)
        else:
            array = _dequantize_with_gguf(raw, tensor)
        return torch.from_numpy(array).view(tensor.shape)


def _string(buf: memoryview, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    end = pos + 8 + n
    if end > len(buf):
        raise ValueError("a string runs past the end of the file")
    return str(buf[pos + 8 : end], "utf-8"), end


def _strings(buf: memoryview, pos: int, count: int) -> tuple[list[str], int]:
    """An array of ``count`` strings from ``pos``: :func:`_string` inlined into one loop, since a vocabulary and
    its merges are hundreds of thousands of them (the call per string was most of a header's parse)."""
    unpack, size, items = _U64.unpack_from, len(buf), []
    append = items.append
    for _ in range(count):
        start = pos + 8
        pos = start + unpack(buf, pos)[0]
        if pos > size:
            raise ValueError("a string runs past the end of the file")
        append(str(buf[start:pos], "utf-8"))
    return items, pos


_U64 = struct.Struct("<Q")


def _value(buf: memoryview, pos: int, vtype: int, depth: int, items_left: list[int]) -> tuple[Any, int]:
    """The value of type ``vtype`` at ``pos`` and the position after it; ``items_left[0]``: how many more array items
    the header may hold (:data:`MAX_METADATA_ITEMS`), counted down."""
    if vtype == _STRING:
        return _string(buf, pos)
    if vtype in _SCALARS:
        fmt = _SCALARS[vtype]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if vtype == _ARRAY:
        item_type, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if item_type not in _MIN_ITEM_BYTES:
            raise ValueError(f"unknown array item type {item_type}")
        if count * _MIN_ITEM_BYTES[item_type] > len(buf) - pos:
            raise ValueError(f"an array of {count} items runs past the end of the file")
        items_left[0] -= count
        if items_left[0] < 0:
            raise ValueError(f"an array of {count} items takes the header's arrays past MAX_METADATA_ITEMS = "
                             f"{MAX_METADATA_ITEMS} items in all")
        if item_type in _NUMPY:
            dtype = np.dtype(_NUMPY[item_type]).newbyteorder("<")
            values = np.frombuffer(buf, dtype=dtype, count=count, offset=pos)
            return values.tolist(), pos + count * dtype.itemsize
        if item_type == _STRING:
            return _strings(buf, pos, count)
        if item_type == _ARRAY and depth >= _MAX_DEPTH:
            raise ValueError(f"arrays nested more than {_MAX_DEPTH} deep")
        items = []
        for _ in range(count):
            item, pos = _value(buf, pos, item_type, depth + 1, items_left)
            items.append(item)
        return items, pos
    raise ValueError(f"unknown metadata value type {vtype}")


def _block(ggml_type: int, name: str) -> tuple[int, int]:
    if ggml_type in _BLOCKS:
        return _BLOCKS[ggml_type]
    if ggml_type in _GGML_TYPES:
        return _GGML_TYPES[ggml_type][1:]
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError) as exc:
        raise ModelLoadError(f"GGUF tensor {name!r} has an unknown ggml type {ggml_type}") from exc


def _dequantize_blocks(blocks: np.ndarray, kind: int) -> np.ndarray:
    """Q4_0 / Q4_1 / Q8_0 blocks ``[n, bytes]`` -> float32 ``[n * 32]``, as ggml lays them out.

    In place on one output array: the temporaries of the plain expression cost 5x the time.
    """
    layout = _LAYOUTS[kind]
    d = blocks[:, :2].view(np.float16).astype(np.float32)  # [n, 1] scale
    qs = blocks[:, layout.head:]  # [n, 32 / (8 / bits)] quants
    if layout.bits == 8:
        out = qs.view(np.int8).astype(np.float32)  # [n, 32]
        out *= d
        return out.reshape(-1)
    # 4 bits: element j is the low nibble of byte j, element j + 16 its high nibble.
    half = layout.quant_bytes
    q = np.empty((blocks.shape[0], 2 * half), dtype=np.uint8)  # [n, 32]
    np.bitwise_and(qs, 0x0F, out=q[:, :half])
    np.right_shift(qs, 4, out=q[:, half:])
    out = q.astype(np.float32)  # [n, 32]
    if not layout.has_min:  # Q4_0: q - 8
        out -= np.float32(8)
        out *= d
    else:
        out *= d
        out += blocks[:, 2:4].view(np.float16).astype(np.float32)  # the block's minimum m
    return out.reshape(-1)


def _dequantize_with_gguf(raw: np.ndarray, tensor: GGUFTensor) -> np.ndarray:
    from gguf import quants
    from gguf.constants import GGMLQuantizationType

    try:
        qtype = GGMLQuantizationType(tensor.ggml_type)
        array = quants.dequantize(raw.reshape(-1, _row_bytes(tensor)), qtype)
    except (NotImplementedError, ValueError) as exc:
        raise ModelLoadError(f"GGUF tensor {tensor.name!r}: {tensor.type_name} is not supported: {exc}") from exc
    return np.ascontiguousarray(array, dtype=np.float32)


def _row_bytes(tensor: GGUFTensor) -> int:
    block, size = _block(tensor.ggml_type, tensor.name)
    return tensor.shape[-1] // block * size
