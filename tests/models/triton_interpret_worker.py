"""Runs the Triton paged-decode kernel in Triton's interpreter for tests/models/test_triton_decode.py.

Usage: ``TRITON_INTERPRET=1 python tests/models/triton_interpret_worker.py CASES OUT``. Triton decides
between compiling and interpreting when a kernel is defined (at its module's import), from the
environment, so the interpreter needs its own process: setting ``TRITON_INTERPRET`` inside the pytest
process would reach every other test that imports Triton (torch.compile's inductor among them). CASES is
a ``torch.save``d list of cases, each a dict with ``kind``:

- ``"kernel"``: ``paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, window=,
  softcap=)`` on the case's tensors;
- ``"backend"``: ``TritonDecodeBackend``'s ``build_metadata`` on the case's lists, then its ``forward``.

OUT gets, in the cases' order, ``(output, strides)``: the attention's ``[T, H, D]`` and the strides of the
case's tensors as this process received them (``torch.save`` keeps views' strides).
"""

from __future__ import annotations

import os
import sys

import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("triton_interpret_worker.py runs the kernel in Triton's interpreter: start it with TRITON_INTERPRET=1")

from asyncinfer.models.attention.triton_backend import TritonDecodeBackend
from asyncinfer.models.attention.triton_decode import paged_decode_attention


def run(case: dict) -> torch.Tensor:
    if case["kind"] == "kernel":
        return paged_decode_attention(case["q"], case["k_cache"], case["v_cache"], case["block_tables"],
                                      case["context_lens"], case["scale"], window=case["window"],
                                      softcap=case["softcap"])
    backend = TritonDecodeBackend()
    meta = backend.build_metadata(query_lens=case["query_lens"], context_lens=case["context_lens"],
                                  block_tables=case["block_tables"], slot_mapping=case["slot_mapping"],
                                  block_size=case["k_cache"].shape[1], device="cpu")
    return backend.forward(case["q"], case["k"], case["v"], (case["k_cache"], case["v_cache"]), meta, case["scale"],
                           window=case["window"], softcap=case["softcap"])


def main() -> None:
    cases_path, out_path = sys.argv[1], sys.argv[2]
    cases = torch.load(cases_path, weights_only=False)
    torch.save([(run(case), {name: tuple(value.stride()) for name, value in case.items()
                             if isinstance(value, torch.Tensor)}) for case in cases], out_path)


if __name__ == "__main__":
    main()
