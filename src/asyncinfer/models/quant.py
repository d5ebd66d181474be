"""Weight-only int8 linear layers for CPUs (the article's section 2.3: move fewer bytes).

Weights are quantized once, symmetric per output channel; activations are
quantized per call (dynamic quantization) by PyTorch's x86/fbgemm kernels. On a
2-core AVX2 machine this runs SmolLM2's projections 3-5x faster than fp32 at
decode batch sizes (``benchmarks/throughput.py --quantization int8`` measures it).

Not every layer tolerates int8 equally: ``skip`` keeps named layers in the
engine dtype. ``benchmarks/int8_sensitivity.py`` measures each choice; on SmolLM2-135M
the MLP down projection (whose inputs carry the SwiGLU outliers) is by far the most
sensitive, so the engine keeps it in float32 by default (``quantization_skip``).
Activations are quantized per tensor, so a small model loses accuracy: this is an
opt-in speed/accuracy trade, never the default.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch
from torch import nn

from asyncinfer.errors import InvalidParameterError

QUANTIZATION_METHODS = ("int8",)


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
        self.nbytes = w.numel() + 4 * w.shape[0] + (0 if b is None else 4 * b.numel())

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
    quantized weights now take (the engine counts them in its memory plan).
    """
    skip = tuple(skip)
    nbytes = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if child_name == "lm_head":
                continue  # handled below, together with a tied head
            if isinstance(child, nn.Linear) and not any(s in full for s in skip):
                q = Int8DynamicLinear(child.weight, child.bias)
                setattr(module, child_name, q)
                nbytes += q.nbytes
    if hasattr(model, "lm_head_weight") and not any(s in "lm_head" for s in skip if s):
        head = Int8DynamicLinear(model.lm_head_weight, None)
        model.output_proj = head  # compute_logits uses it; a tied embedding stays float for lookups
        nbytes += head.nbytes
        if getattr(model, "lm_head", None) is not None:
            model.lm_head = None  # the float copy is no longer needed
    return nbytes


def quantized_weight_bytes(model: nn.Module, skip: Iterable[str] = ()) -> int:
    """Quantize ``model`` in place (see :func:`quantize_int8`); return all its weight bytes after."""
    int8_bytes = quantize_int8(model, skip)
    return int8_bytes + sum(p.numel() * p.element_size() for p in model.parameters())
