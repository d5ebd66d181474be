"""The argument checks every public kernel entry makes before a compiled call: the kernels read and write raw
host memory where they are told, so anything they cannot take is refused here with a typed error naming the
parameter and what it allows.

TypeError: not a tensor, another device (the kernels read host memory: CPU tensors only), another layout or
dtype, a shape of another kind, non-contiguous where the kernel needs contiguous, a negated or conjugated view
(torch's lazy ``is_neg()`` / ``is_conj()`` bit, e.g. ``z.conj().imag``: the kernels would read the values
unnegated); ValueError: a size outside its range (0 where the kernel divides by it, products beyond
:data:`MAX_BYTES`), a tensor whose storage does not hold its elements (freed with
``untyped_storage().resize_(0)``); IndexError: an index outside its table (token ids, positions, context
lengths, slots, block ids)."""

from __future__ import annotations

import ctypes
import functools
import numbers
import operator
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

#: The largest byte count (and element count) a kernel is asked to address: every int64 product the C
#: computes from sizes that pass these checks stays below 2**63.
MAX_BYTES = 2**62


def tensor(name: str, t: object, dtype: torch.dtype | None = None, allowed: str = "") -> torch.Tensor:
    """``t`` itself, once it is a strided CPU tensor (of ``dtype``, if given); else TypeError naming ``name``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a CPU torch.Tensor{allowed and ' ' + allowed}, got {type(t).__name__}")
    if not t.is_cpu or t.layout != torch.strided or t.is_nested:
        raise TypeError(f"{name} must be a strided CPU tensor (the kernels read host memory), got a "
                        f"{'nested ' if t.is_nested else ''}{t.layout} tensor on {t.device}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} must be a {dtype} tensor{allowed and ' ' + allowed}, got {t.dtype} "
                        f"{tuple(t.shape)}")
    return memory(name, t)


#: What the checks and the calls read of a tensor: a subclass that overrides any of them (or intercepts every method
#: with ``__torch_function__``) may show the checks one tensor and hand the kernel another's pointer.
_READ = ("data_ptr", "shape", "stride", "storage_offset", "untyped_storage", "element_size", "is_contiguous", "dim",
         "numel", "dtype", "is_cpu", "layout", "is_nested", "is_neg", "is_conj", "device", "__torch_function__",
         "__torch_dispatch__")


@functools.cache
def _reads_as_a_tensor(cls: type) -> bool:
    """Whether tensors of ``cls`` answer what the checks read as torch.Tensor does (nn.Parameter does)."""
    def owner(c: type, name: str) -> type | None:  # the class whose own definition of ``name`` ``c`` uses
        return next((k for k in c.__mro__ if name in vars(k)), None)

    return cls is torch.Tensor or cls is torch.nn.Parameter or all(
        owner(cls, name) is owner(torch.Tensor, name) for name in _READ)


def memory(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, once a strided CPU tensor's bytes are what the kernels read at its data pointer: TypeError
    for a negated or conjugated view (the bit torch resolves lazily) or a tensor subclass that answers any of what the
    checks read (``data_ptr``, ``shape``, ``stride``...) its own way; ValueError when its storage does not
    reach its last element (a storage freed or shrunk in place: ``untyped_storage().resize_(0)``)."""
    if not _reads_as_a_tensor(type(t)):
        raise TypeError(f"{name} is a {type(t).__name__}, a torch.Tensor subclass with its own data_ptr, shape, "
                        f"stride or __torch_function__: pass a plain tensor ({name}.as_subclass(torch.Tensor))")
    if t.is_neg() or t.is_conj():
        raise TypeError(f"{name} is a lazily negated or conjugated view (is_neg() / is_conj()), whose memory "
                        f"holds other values; pass {name}.resolve_neg() / {name}.resolve_conj()")
    if t.numel():
        extent = t.storage_offset() + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        have = t.untyped_storage().nbytes()
        if extent * t.element_size() > have:
            raise ValueError(f"{name}: its storage holds {have} bytes, not the {extent * t.element_size()} its "
                             f"{tuple(t.shape)} elements reach (freed or shrunk in place?)")
    return t


def size(name: str, value: object, lo: int = 1, hi: int = MAX_BYTES) -> int:
    """``value`` as an int in [lo, hi]: TypeError for a non-int (bool included), ValueError outside the range."""
    if isinstance(value, (bool, torch.Tensor)):
        raise TypeError(f"{name} must be an int in [{lo}, {hi}], got {type(value).__name__}")
    try:
        v = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an int in [{lo}, {hi}], got {type(value).__name__}") from None
    if not lo <= v <= hi:
        raise ValueError(f"{name}={v} is outside its range [{lo}, {hi}]")
    return v


def real(name: str, value: object) -> float:
    """``value`` as a float (eps, scale): TypeError for anything but a real number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def softcap(name: str, value: object) -> float:
    """A soft-cap (``cap * tanh(x / cap)``) as the float32 the kernels take: TypeError for anything but a real
    number, ValueError naming ``name`` unless it stays positive and finite there (``1e-46`` passed ``> 0`` and
    reached the kernels as 0.0, which they read as no cap at all)."""
    cap = real(name, value)
    if not (0.0 < cap < 3.4e38 and ctypes.c_float(cap).value > 0.0):
        raise ValueError(f"{name} must be None or a positive finite float32, got {value!r}")
    return cap


def bounded(name: str, *factors: int, limit: int = MAX_BYTES) -> None:
    """ValueError naming ``name`` when the product of ``factors`` exceeds ``limit`` (2**62)."""
    product = 1
    for f in factors:
        product *= f
    if product > limit:
        raise ValueError(f"{name}: {' x '.join(map(str, factors))} = {product} is beyond what the kernels address "
                         f"(at most 2**62)")


def empty(shape: tuple[int, ...], what: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """torch.empty, with a failed allocation raised as MemoryError naming ``what``."""
    try:
        return torch.empty(shape, dtype=dtype)
    except RuntimeError as exc:
        raise MemoryError(f"{what}: cannot allocate {dtype} {shape}: {exc}") from exc


def out_of_memory(exc: RuntimeError, what: str) -> BaseException:
    """torch's failed CPU allocation (a RuntimeError) as the MemoryError it is, naming ``what``; any other
    RuntimeError unchanged."""
    if "allocate" in str(exc) or "overflow" in str(exc):
        return MemoryError(f"{what}: {exc}")
    return exc


def contiguous(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t.contiguous()``, a failed allocation (an expanded tensor of huge sizes) raised as MemoryError."""
    try:
        return t.contiguous()
    except RuntimeError as exc:
        raise out_of_memory(exc, what) from exc


def allocating(what: str) -> Callable[[F], F]:
    """Decorate a pure-torch function so that a failed allocation is raised as MemoryError naming ``what``."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except RuntimeError as exc:
                raise out_of_memory(exc, what) from exc

        return run  # type: ignore[return-value]

    return wrap
