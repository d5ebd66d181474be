"""The KV cache layout, defined once: :class:`KVCacheSpec`.

One frozen spec is built per model version (``KVCacheSpec.from_model_config``)
and read by everything that depends on the layout: the memory planner
(``memory.plan_kv_cache``: bytes per block), the KV tensors
(``kv_tensors.allocate_kv_caches``: one ``layer_shape`` tensor for K and one
for V per layer), the block manager (``block_size``) and the runner
(``block_size``, ``device``). Nothing else restates the layout.

Plain Python like the rest of ``cache/``: the spec carries a ``torch.dtype`` and
a ``torch.device`` but does not import torch; it checks them by the attributes
it reads (``dtype.itemsize``, ``dtype.is_floating_point``, ``device.type``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from asyncinfer.errors import InvalidParameterError

if TYPE_CHECKING:
    import torch

    from asyncinfer.models.config import ModelConfig


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape, dtype and device of the paged KV cache.

    Per layer there is one K and one V tensor of ``layer_shape(num_blocks)`` =
    ``(num_blocks, block_size, num_kv_heads, head_dim)``; a token's slot is
    ``block_id * block_size + offset``.

    Raises:
        InvalidParameterError: a count that is not a positive int, a dtype that is
            not a floating-point ``torch.dtype``, or a device that is not a ``torch.device``.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    device: torch.device

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidParameterError(name, value, "a positive int")
        if not isinstance(getattr(self.dtype, "itemsize", None), int) or not getattr(
            self.dtype, "is_floating_point", False
        ):
            raise InvalidParameterError("dtype", self.dtype, "a floating-point torch.dtype")
        if not isinstance(getattr(self.device, "type", None), str):
            raise InvalidParameterError("device", self.device, "a torch.device")

    @classmethod
    def from_model_config(
        cls, model_config: ModelConfig, *, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> KVCacheSpec:
        """The spec of ``model_config``'s decoder with the engine's block size, dtype and device.

        Raises:
            InvalidParameterError: as the constructor (``block_size`` < 1, a non-float dtype, ...).
        """
        return cls(
            num_layers=model_config.num_layers,
            num_kv_heads=model_config.num_kv_heads,
            head_dim=model_config.head_dim,
            block_size=block_size,
            dtype=dtype,
            device=device,
        )

    @property
    def dtype_bytes(self) -> int:
        """Bytes of one cached element."""
        return int(self.dtype.itemsize)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V one token takes across all layers: ``2 x layers x kv_heads x head_dim x dtype_bytes``."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers: ``bytes_per_token x block_size``."""
        return self.bytes_per_token * self.block_size

    def layer_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        """Shape of one layer's K (or V) tensor: ``(num_blocks, block_size, num_kv_heads, head_dim)``."""
        return (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
