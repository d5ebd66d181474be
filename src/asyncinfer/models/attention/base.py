"""The attention-backend contract, its metadata base, and the registry that picks a backend per device.

A backend owns paged attention for one engine: the runner asks it once per
step to turn the step's plain lists into whatever its kernel needs
(:meth:`AttentionBackend.build_metadata`); every layer of the model then calls
``meta.backend.forward(...)`` with that metadata: the metadata carries the
backend that built it, so nothing is global and a model never names a kernel.
A scheduling policy that needs the cost of padding asks the backend through
:meth:`AttentionBackend.decode_padding` (plain Python; the engine hands the
bound function to the scheduler, which never imports torch or models).

Built-in backends are imported only when selected (``_BUILTIN``: "sdpa", and
"triton", the CUDA default where the triton package imports); another CUDA
kernel (FlashInfer) or a faster CPU kernel slots in with
:func:`register_attention_backend` (optionally as a device's default), or by a
``"package.module:Class"`` path passed as ``name``.

This module imports no torch at run time: the lab and the schedulers' callers
may read it without loading a kernel.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from asyncinfer.errors import InvalidParameterError

if TYPE_CHECKING:
    import torch

    KVCache = tuple[torch.Tensor, torch.Tensor]


class AttentionBackend(abc.ABC):
    """Paged attention over a flattened, unpadded batch, behind one small contract.

    A step's batch is ``S`` sequences whose new tokens are concatenated
    (``T`` tokens in all): first the decodes (one new token each), then the
    prefill chunks (one or more tokens, possibly after a prefix already in the
    cache). The KV cache of one layer is a ``(k_cache, v_cache)`` pair, each
    ``KVCacheSpec.layer_shape(num_blocks)`` = ``[num_blocks, block_size,
    num_kv_heads, head_dim]``; a token's slot is ``block_id * block_size + offset``.
    Padding entries of a block table may point at any block (block 0 by
    convention): a backend must never let them change the result.

    A backend implements:

    - :meth:`build_metadata`: from the step's plain lists, once per step, the
      metadata every layer shares (an :class:`AttentionMetadata` whose
      ``backend`` is this backend). Validates the lists.
    - :meth:`forward`: for one layer, write this step's K/V into their cache
      slots, then attend every query over its own sequence's context
      (causally: query ``j`` of a chunk sees keys up to its own position; within
      the layer's sliding window, when it has one; with soft-capped scores, when asked).
    - :meth:`decode_padding`: plain Python, no tensors; how many keys beyond
      the real contexts the backend computes for a batch of decodes (a kernel
      that reads blocks in place returns 0).

    Class attributes: ``name`` (the registry's name) and ``device_types``
    (the ``torch.device`` types it runs on).
    """

    name: ClassVar[str]
    device_types: ClassVar[tuple[str, ...]]

    @abc.abstractmethod
    def build_metadata(
        self,
        *,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        slot_mapping: Sequence[int],
        block_size: int,
        device: torch.device | str,
    ) -> AttentionMetadata:
        """The step's metadata, built once and shared by every layer.

        ``query_lens[i]``: sequence i's new tokens this step (decodes, 1, first);
        ``context_lens[i]``: its tokens in the cache *after* this step's write;
        ``block_tables[i]``: its block ids in order (may be longer than needed);
        ``slot_mapping``: the cache slot of each new token, ``sum(query_lens)`` of them.

        Raises:
            InvalidParameterError: lists of different lengths, a ``query_len`` outside
                ``[1, context_len]``, a decode after a prefill, a block table too short
                for its context, a slot mapping of the wrong length, or ``block_size < 1``.
        """

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        *,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Write ``k``/``v`` into ``kv_cache`` at ``meta``'s slots, then attend; returns ``[T, H, D]``.

        ``q``: ``[T, H, D]``; ``k``, ``v``: ``[T, KVH, D]`` (``H`` a multiple of ``KVH``:
        grouped-query attention); ``scale``: the softmax scale (usually ``D ** -0.5``).
        ``window``: this layer's sliding window, the query at position ``p`` sees the keys at
        ``p - window + 1 .. p`` only (None: its whole context). ``softcap``: the scores
        ``scale * q.k`` become ``softcap * tanh(scores / softcap)`` before the softmax (Gemma 2;
        None: as they are). The model passes these only to layers that have them.
        The caches are updated in place.
        """

    @staticmethod
    @abc.abstractmethod
    def decode_padding(context_lens: Sequence[int], block_size: int) -> int:
        """Keys computed beyond the real contexts when these decodes run in one step (>= 0).

        ``context_lens``: each decode's context, its new token included. Plain Python.
        """


class AttentionMetadata:
    """Base of every backend's per-step metadata; ``backend`` is the backend that built it.

    The model's attention layers call ``meta.backend.forward(q, k, v, kv_cache, meta, scale)``;
    everything else in the metadata is the backend's own business.
    """

    backend: AttentionBackend

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        slot_mapping: Sequence[int],
        block_size: int,
        device: torch.device | str,
    ) -> AttentionMetadata:
        """Build a step's metadata with ``device``'s default backend (for drivers that hold none).

        Raises:
            InvalidParameterError: as :meth:`AttentionBackend.build_metadata`.
        """
        return select_attention_backend(device).build_metadata(
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            block_size=block_size,
            device=device,
        )


# Lazily imported built-ins: a backend costs nothing until it is selected.
_BUILTIN: dict[str, str] = {
    "sdpa": "asyncinfer.models.attention.sdpa:SdpaBackend",
    "triton": "asyncinfer.models.attention.triton_backend:TritonDecodeBackend",  # needs the triton package
}
_REGISTERED: dict[str, type[AttentionBackend]] = {}
# The backend a device type gets when none is named, as registered (register_attention_backend's default_for).
_DEVICE_DEFAULTS: dict[str, str] = {}
# Where nothing is registered for a device type: its built-in defaults, best first, the first that imports
# here taken; else "sdpa". "triton" is not among CUDA's defaults until a run on a device has confirmed it
# (it is tested through Triton's interpreter only): select it by name or register it as CUDA's default.
_BUILTIN_DEVICE_DEFAULTS: dict[str, tuple[str, ...]] = {"cuda": ("sdpa",)}


def register_attention_backend(
    cls: type[AttentionBackend], *, default_for: Iterable[str] = ()
) -> type[AttentionBackend]:
    """Make ``cls`` selectable as ``cls.name`` in this process; ``default_for``: device types it becomes the default of.

    Raises:
        InvalidParameterError: ``cls`` is not an :class:`AttentionBackend` subclass with a ``name``,
            or ``default_for`` names a device type it does not run on.
    """
    if not (isinstance(cls, type) and issubclass(cls, AttentionBackend) and isinstance(getattr(cls, "name", None), str)):
        raise InvalidParameterError("attention backend", cls, "an AttentionBackend subclass with a name")
    defaults = list(default_for)
    for device_type in defaults:
        if device_type not in cls.device_types:
            raise InvalidParameterError("default_for", device_type, f"one of {cls.name}'s {list(cls.device_types)}")
    _REGISTERED[cls.name] = cls
    _DEVICE_DEFAULTS.update(dict.fromkeys(defaults, cls.name))
    return cls


def available_attention_backends() -> list[str]:
    """The names :func:`select_attention_backend` accepts here (built-in and registered)."""
    return sorted(set(_BUILTIN) | set(_REGISTERED))


def select_attention_backend(
    device: torch.device | str, name: str | type[AttentionBackend] | None = None
) -> AttentionBackend:
    """A fresh instance of the backend ``name`` (default: ``device``'s default backend).

    ``name``: a registered or built-in name, an :class:`AttentionBackend` subclass,
    or a ``"package.module:Class"`` path. A device's default is the backend registered as its default,
    else its first built-in default that imports here: "sdpa" on every device ("triton", the Triton
    paged-decode kernel, is opt-in on CUDA by name or as a registered default until a device run confirms it).

    Raises:
        InvalidParameterError: an unknown name or path, not an AttentionBackend
            subclass, or a backend that does not run on ``device``'s type.
    """
    device_type = _device_type(device)
    if name is None and device_type not in _DEVICE_DEFAULTS:
        return _builtin_default(device_type)()
    spec = _DEVICE_DEFAULTS[device_type] if name is None else name
    cls = _resolve(spec)
    if device_type not in cls.device_types:
        raise InvalidParameterError("attention_backend", spec, f"a backend that runs on {device_type!r}")
    return cls()


def _builtin_default(device_type: str) -> type[AttentionBackend]:
    """The first of ``device_type``'s built-in defaults whose module imports ("sdpa" always does)."""
    for name in _BUILTIN_DEVICE_DEFAULTS.get(device_type, ()):
        try:
            return _resolve(name)
        except InvalidParameterError:  # its module does not import here (no triton package)
            continue
    return _resolve("sdpa")


def _device_type(device: Any) -> str:
    return device.split(":", 1)[0] if isinstance(device, str) else str(device.type)


def _resolve(spec: str | type[AttentionBackend]) -> type[AttentionBackend]:
    if isinstance(spec, type):
        cls: object = spec
    elif isinstance(spec, str) and spec in _REGISTERED:
        cls = _REGISTERED[spec]
    elif isinstance(spec, str) and (spec in _BUILTIN or ":" in spec):
        module, _, attr = _BUILTIN.get(spec, spec).partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise InvalidParameterError("attention_backend", spec, f"an importable 'module:Class' ({exc})") from exc
    else:
        raise InvalidParameterError("attention_backend", spec, f"one of {available_attention_backends()} or 'module:Class'")
    if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
        raise InvalidParameterError("attention_backend", spec, "a subclass of asyncinfer.models.attention.AttentionBackend")
    return cls
