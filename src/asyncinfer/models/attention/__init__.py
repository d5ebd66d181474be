"""Attention backends: one contract (:class:`AttentionBackend`), chosen per device.

``select_attention_backend(device, name=None)`` returns the backend a device
runs ("sdpa", :mod:`asyncinfer.models.attention.sdpa`, on every device; "triton",
:mod:`asyncinfer.models.attention.triton_backend`, decodes in a Triton paged-attention kernel on CUDA
when named or registered as CUDA's default); ``register_attention_backend`` adds one. See :mod:`asyncinfer.models.attention.base`
for the contract.
"""

from asyncinfer.models.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    available_attention_backends,
    register_attention_backend,
    select_attention_backend,
)

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "available_attention_backends",
    "register_attention_backend",
    "select_attention_backend",
]
