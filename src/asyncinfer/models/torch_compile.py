"""``torch_compile=True``: the decoder's element-wise chains compiled by ``torch.compile``.

Three chains run between the projections of every layer: RMSNorm (square, mean, rsqrt,
two multiplies), the rotary embedding (slices, four multiplies, two adds, a concat) and
SwiGLU's ``silu(gate) * up``. Eager PyTorch runs each op as its own kernel, reading and
writing the activations every time (and, on CUDA, launching one kernel per op);
``torch.compile`` fuses each chain into one kernel (C++ on a CPU, Triton on CUDA).

The projections, the attention backend and the paged KV cache stay eager: only these pure
functions are compiled (once per model, with dynamic token counts), so the engine's
step, its batch shapes and its formats are unchanged. The compiled functions are an
:class:`~asyncinfer.models.layers.ElementwiseOps` record, built before the model is: the
loader constructs the model with it (``Checkpoint.load(..., ops=...)``), and no module
is patched afterwards. The compilation runs at load, before the weights are read, on
tensors of the model's shapes, so its time is paid there (and reported as
``ModelVersionInfo.compile_seconds``) rather than by the first request, and a machine that
cannot compile (no C++ compiler for a CPU; no Triton for CUDA) fails the load with a
:class:`~asyncinfer.errors.ConfigurationError` that says so.

Measured, not assumed: ``benchmarks/throughput.py --compile`` runs the engine eager and
compiled side by side (docs/formats.md has the figures). It is off by default.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from asyncinfer.errors import ConfigurationError
from asyncinfer.models.config import ModelConfig
from asyncinfer.models.layers import ElementwiseOps, apply_rope, rms_norm, silu_mul_new

logger = logging.getLogger("asyncinfer")


def compile_elementwise_ops(config: ModelConfig, device: torch.device,
                            dtype: torch.dtype) -> tuple[ElementwiseOps, float]:
    """The compiled forms of the eager element-wise functions, compiled now on tensors of ``config``'s
    shapes in ``dtype`` on ``device``, and the seconds that took. Build the model with the record.

    Raises:
        ConfigurationError: ``torch.compile`` failed here (the message names the cause).
    """
    ops = ElementwiseOps(rms_norm=torch.compile(rms_norm, dynamic=True),
                         apply_rope=torch.compile(apply_rope, dynamic=True),
                         silu_mul=torch.compile(silu_mul_new, dynamic=True))
    start = time.perf_counter()
    try:
        _warm_up(ops, config, device, dtype)
    except Exception as exc:  # inductor's errors have no common base class
        what = "a C++ compiler (g++ or clang)" if device.type == "cpu" else "Triton"
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else "no message"
        raise ConfigurationError(
            f"torch_compile=True: torch.compile failed on this machine ({type(exc).__name__}: {first_line}); "
            f"it needs {what}. Load with torch_compile=False (the default)"
        ) from exc
    seconds = time.perf_counter() - start
    logger.info("torch_compile: the decoder's element-wise chains compiled in %.1f s", seconds)
    return ops, seconds


def _warm_up(ops: ElementwiseOps, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
    """Call each compiled function as the layers do (a norm weight as the loader leaves it; a q/k view
    of a fused qkv row; separate cos and sin), for 1 token (its own graph) and 3 (any other count: dynamic)."""
    # Made outside inference mode, as the loader makes the weights: a parameter that needs no grad (the
    # compiled code is guarded on its type and dispatch keys, which an inference tensor's differ in).
    weight = nn.Parameter(torch.ones(config.hidden_size, device=device, dtype=dtype), requires_grad=False)
    heads = config.num_heads + config.num_kv_heads
    with torch.inference_mode():  # as the runner calls them: grad mode is among what the code is guarded on
        for tokens in (1, 3):
            x = torch.randn(tokens, config.hidden_size, device=device, dtype=dtype)
            ops.rms_norm(x, weight, config.rms_norm_eps)
            qkv = torch.randn(tokens, config.q_size + 2 * config.kv_size, device=device, dtype=dtype)
            qk = qkv[:, : heads * config.head_dim].view(tokens, heads, config.head_dim)  # a view, as in attention
            cos = torch.randn(tokens, 1, config.head_dim // 2, device=device, dtype=dtype)
            sin = torch.randn(tokens, 1, config.head_dim // 2, device=device, dtype=dtype)
            ops.apply_rope(qk, cos, sin)
            ops.silu_mul(torch.randn(tokens, 2 * config.intermediate_size, device=device, dtype=dtype),
                         config.intermediate_size)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
