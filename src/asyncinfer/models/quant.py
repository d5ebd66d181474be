"""Weight-only int8 linear layers for CPUs: decode is bound by the bytes of weights read, so move fewer.

Weights are quantized once, symmetric per output channel; activations are
quantized per call (dynamic quantization) by PyTorch's x86/fbgemm kernels. On a
2-core AVX2 machine this runs SmolLM2's projections 3-5x faster than fp32 at
decode batch sizes (``benchmarks/throughput.py --int8`` measures it).

Not every layer tolerates int8 equally: ``skip`` keeps named layers in the
engine dtype. ``benchmarks/int8_sensitivity.py`` measures each choice; on SmolLM2-135M
the MLP down projection (whose inputs carry the SwiGLU outliers) is by far the most
sensitive, so the engine keeps it in float32 by default (``quantization_skip``).
Activations are quantized per tensor, so a small model loses accuracy: this is an
opt-in speed/accuracy trade, never the default.

:func:`weight_bytes` is the one weight-size calculation of the package: from the
config alone, with or without int8, it counts what :func:`quantize_int8` leaves
(the memory planner before loading and the start-up path after it both use it).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from asyncinfer.errors import InvalidParameterError
from asyncinfer.models.meta import build_on_meta

if TYPE_CHECKING:
    from asyncinfer.models.config import ModelConfig

QUANTIZATION_METHODS = ("int8",)


def int8_linear_bytes(out_features: int, in_features: int, *, bias: bool) -> int:
    """Bytes of one :class:`Int8DynamicLinear`: int8 weights, a float32 scale per output
    channel, and a float32 bias when there is one."""
    return out_features * in_features + 4 * out_features + (4 * out_features if bias else 0)


class Int8DynamicLinear(nn.Module):
    """``y = x @ W.T + b`` with W stored as int8 (per-channel scales) in a prepacked kernel format."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)  # [out]
        zero = torch.zeros(w.shape[0], dtype=torch.long)  # [out]
        with warnings.catch_warnings():  # torch flags its quantized-tensor API as deprecated
            warnings.simplefilter("ignore")
            wq = torch.quantize_per_channel(w, scale.double(), zero, 0, torch.qint8)  # [out, in]
        b = None if bias is None else bias.detach().float()
        self._packed = torch.ops.quantized.linear_prepack(wq, b)
        self.in_features = w.shape[1]
        self.out_features = w.shape[0]
        self.nbytes = int8_linear_bytes(self.out_features, self.in_features, bias=b is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # reduce_range=False: full 8-bit activations. The 7-bit range is safer against
        # int16 saturation on CPUs without VNNI, but cost SmolLM2 17 points of top-1
        # agreement in benchmarks/int8_sensitivity.py, far more than saturation did.
        return torch.ops.quantized.linear_dynamic(x, self._packed, False)  # [T, out]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def check_quantization(method: str | None, device: torch.device, dtype: torch.dtype) -> None:
    """Validate the ``quantization`` option against the device and dtype."""
    if method is None:
        return
    if method not in QUANTIZATION_METHODS:
        raise InvalidParameterError("quantization", method, f"None or one of {list(QUANTIZATION_METHODS)}")
    if device.type != "cpu" or dtype != torch.float32:
        raise InvalidParameterError(
            "quantization", method, "None on CUDA or with a non-float32 dtype (int8 runs on CPU with float32)"
        )


def quantize_int8(model: nn.Module, skip: Iterable[str] = ()) -> int:
    """Replace every ``nn.Linear`` (and the LM head) of ``model`` with :class:`Int8DynamicLinear`, in place.

    ``skip``: substrings of module names to keep unquantized. Returns the bytes the
    int8 layers take (:func:`weight_bytes` counts the same from the config alone).
    """
    skip = tuple(skip)
    nbytes = 0
    for parent, name, linear in _int8_linears(model, skip):
        q = Int8DynamicLinear(linear.weight, linear.bias)
        setattr(parent, name, q)
        nbytes += q.nbytes
    if _int8_head(model, skip):
        head = Int8DynamicLinear(model.lm_head_weight, None)
        model.output_proj = head  # compute_logits uses it; a tied embedding stays float for lookups
        nbytes += head.nbytes
        if getattr(model, "lm_head", None) is not None:
            model.lm_head = None  # the float copy is no longer needed
    return nbytes


def weight_bytes(
    model_config: ModelConfig, dtype_bytes: int, quantization: str | None = None, skip: Iterable[str] = ()
) -> int:
    """Bytes the model's weights take once loaded in a ``dtype_bytes`` dtype (and quantized), from its config alone.

    The one weight-size calculation: the memory planner (before loading) and the
    start-up path (after loading) both use it. Nothing is loaded or changed: the
    family's model is built on the meta device and its layers are counted as
    :func:`quantize_int8` would leave them (``quantization="int8"``, ``skip`` as there).

    Raises:
        InvalidParameterError: ``quantization`` is not None or one of ``QUANTIZATION_METHODS``.
        ModelLoadError: the config's architecture is not registered.
    """
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise InvalidParameterError("quantization", quantization, f"None or one of {list(QUANTIZATION_METHODS)}")
    model = build_on_meta(model_config)
    total = _float_bytes(model, dtype_bytes)
    if quantization is None:
        return total
    skip = tuple(skip)
    for _, _, linear in _int8_linears(model, skip):
        total += int8_linear_bytes(*linear.weight.shape, bias=linear.bias is not None) - _float_bytes(linear, dtype_bytes)
    if _int8_head(model, skip):
        total += int8_linear_bytes(*model.lm_head_weight.shape, bias=False)
        if getattr(model, "lm_head", None) is not None:
            total -= _float_bytes(model.lm_head, dtype_bytes)
    return total


def _float_bytes(module: nn.Module, dtype_bytes: int) -> int:
    return sum(p.numel() for p in module.parameters()) * dtype_bytes


def _int8_linears(model: nn.Module, skip: tuple[str, ...]) -> list[tuple[nn.Module, str, nn.Linear]]:
    """``(parent, attribute, layer)`` of every ``nn.Linear`` int8 replaces; the LM head is :func:`_int8_head`'s."""
    found = []
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            full = f"{name}.{child_name}" if name else child_name
            if child_name != "lm_head" and isinstance(child, nn.Linear) and not any(s in full for s in skip):
                found.append((module, child_name, child))
    return found


def _int8_head(model: nn.Module, skip: tuple[str, ...]) -> bool:
    """Whether int8 replaces the output projection (a tied head included)."""
    return hasattr(model, "lm_head_weight") and not any(s in "lm_head" for s in skip if s)
