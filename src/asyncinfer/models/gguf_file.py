"""A GGUF file read once: header, metadata and tensor index in one pass, tensors dequantised in torch.

``gguf.GGUFReader`` builds a numpy view per field part (about 300 000 of them for a
49k-token vocabulary), which took ~13 s per parse of SmolLM2-135M on a 2-core CPU;
this reader walks the same bytes with ``struct`` and takes ~0.1 s. The format
(https://github.com/ggml-org/ggml/blob/master/docs/gguf.md), little-endian only:

    magic "GGUF", version (u32), tensor count (u64), metadata count (u64),
    metadata: key (string), value type (u32), value,
    tensor infos: name (string), n_dims (u32), dims (u64 each, fastest first), type (u32), offset (u64),
    padding to ``general.alignment`` (default 32), then the tensor data.

Q4_0, Q4_1 and Q8_0 are dequantised with whole-tensor numpy ops, bit-identical to
``gguf.quants`` (the same float32 multiply, then add) but without its per-16-row
Python loop; other quantised types go through ``gguf.quants.dequantize``. Numpy,
not torch: torch's intra-op threads spin-wait, and on a busy 2-core machine that
turned 0.6 s of dequantisation into 26 s, while numpy's single thread never waits.
"""

from __future__ import annotations

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
_DEFAULT_ALIGNMENT = 32

# Metadata value types: struct format of the scalar ones; 8 = string, 9 = array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9

# ggml tensor types: (elements per block, bytes per block). The block formats' layouts are
# asyncinfer.kernels.formats' (READ_LAYOUTS); the rest come from gguf.constants.
_F32, _F16, _Q4_0, _Q4_1, _Q8_0, _BF16 = 0, 1, 2, 3, 8, 30
_LAYOUTS = {_Q4_0: READ_LAYOUTS["q4_0"], _Q4_1: READ_LAYOUTS["q4_1"], _Q8_0: READ_LAYOUTS["q8_0"]}
_BLOCKS = {_F32: (1, 4), _F16: (1, 2), _BF16: (1, 2),
           **{kind: (layout.weights, layout.nbytes) for kind, layout in _LAYOUTS.items()}}


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
        try:
            from gguf.constants import GGMLQuantizationType

            return GGMLQuantizationType(self.ggml_type).name
        except (ImportError, ValueError):
            return f"ggml type {self.ggml_type}"


class GGUFFile:
    """The parsed header of a ``.gguf`` file; tensors are read from a memory map on demand.

    ``fields``: metadata key -> value (ints, floats, bools, strings, lists).
    ``tensors``: the tensor index, in file order.

    Raises:
        ModelLoadError: not a GGUF file, a big-endian or truncated one.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as fh:
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read GGUF file {self.path}: {exc}") from exc
        try:
            self.fields, self.tensors = self._parse(memoryview(self._map))
        except (struct.error, UnicodeDecodeError, IndexError, ValueError) as exc:
            raise ModelLoadError(f"cannot read GGUF file {self.path}: truncated or corrupt header ({exc})") from exc

    # ------------------------------------------------------------------ parsing
    def _parse(self, buf: memoryview) -> tuple[dict[str, Any], list[GGUFTensor]]:
        if bytes(buf[:4]) != _MAGIC:
            raise ModelLoadError(f"cannot read GGUF file {self.path}: not a GGUF file (bad magic)")
        version, n_tensors, n_fields = struct.unpack_from("<IQQ", buf, 4)
        if version > 0xFFFF:
            raise ModelLoadError(f"cannot read GGUF file {self.path}: big-endian GGUF files are not supported")
        if version < 2:
            raise ModelLoadError(f"cannot read GGUF file {self.path}: GGUF version {version} is not supported")
        pos = 24
        fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key, pos = _string(buf, pos)
            (vtype,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            fields[key], pos = _value(buf, pos, vtype)
        infos = []
        for _ in range(n_tensors):
            name, pos = _string(buf, pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, dims, ggml_type, offset))
        alignment = int(fields.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-pos // alignment) * alignment
        tensors = []
        for name, dims, ggml_type, offset in infos:
            count = int(np.prod(dims)) if dims else 1
            block, size = _block(ggml_type, name)
            nbytes = count // block * size
            start = data_start + offset
            if start + nbytes > len(buf):
                raise ModelLoadError(
                    f"cannot read GGUF file {self.path}: tensor {name!r} runs past the end of the file"
                )
            tensors.append(GGUFTensor(name, tuple(int(d) for d in reversed(dims)), ggml_type, start, nbytes))
        return fields, tensors

    # ------------------------------------------------------------------ tensors
    def raw(self, tensor: GGUFTensor) -> np.ndarray:
        """The tensor's bytes: a read-only ``uint8`` view of the memory map."""
        return np.frombuffer(self._map, dtype=np.uint8, count=tensor.nbytes, offset=tensor.offset)

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


def _value(buf: memoryview, pos: int, vtype: int) -> tuple[Any, int]:
    if vtype == _STRING:
        return _string(buf, pos)
    if vtype in _SCALARS:
        fmt = _SCALARS[vtype]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if vtype == _ARRAY:
        item_type, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if item_type in _NUMPY:
            dtype = np.dtype(_NUMPY[item_type]).newbyteorder("<")
            values = np.frombuffer(buf, dtype=dtype, count=count, offset=pos)
            return values.tolist(), pos + count * dtype.itemsize
        items = []
        for _ in range(count):
            item, pos = _value(buf, pos, item_type)
            items.append(item)
        return items, pos
    raise ValueError(f"unknown metadata value type {vtype}")


def _block(ggml_type: int, name: str) -> tuple[int, int]:
    if ggml_type in _BLOCKS:
        return _BLOCKS[ggml_type]
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
