"""Memory for weights the kernels stream: in transparent huge pages (2 MiB) where Linux grants them.

A decode step reads every weight once, front to back. In 4 KiB pages that is a TLB miss every 64 cache lines,
and the CPU's prefetchers stop at each page's end; in 2 MiB pages the same rows read 1.02-1.25x faster on the
Zen 4 EPYC of docs/formats.md ("Weights in huge pages": the more, the slower the host's small pages read then).
Linux gives an anonymous mapping huge pages when ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always``,
or ``madvise`` and the mapping asks for them (``MADV_HUGEPAGE``), which is what :func:`weight_buffer` does.
Where it cannot (another OS, huge pages ``never``, no ``MADV_HUGEPAGE``; :func:`huge_pages` is False) a buffer is
a plain tensor. :func:`asyncinfer.kernels.pack` makes no copy of blocks a file holds in the kernels' own layout;
the GGUF loader moves a layer's lone tensors in such a layout into a buffer here (``loader.off_the_map``), and
:func:`asyncinfer.kernels.pack_lanes` copies Q4_0's and Q4_1's held in lanes into one.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
from pathlib import Path

import torch

#: The huge page size the buffers align to (x86-64's and most arm64 kernels' transparent huge page).
HUGE_PAGE = 2 << 20
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def huge_pages() -> bool:
    """Whether :func:`weight_buffer` gets transparent huge pages here: Linux, with them ``always`` or ``madvise``
    (read once, at the first call)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        mode = _THP_ENABLED.read_text(encoding="ascii")
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def weight_buffer(nbytes: int) -> torch.Tensor:
    """A new uint8 tensor of ``nbytes`` (its contents undefined), starting on a huge page boundary in a private
    anonymous mapping that asks for huge pages where :func:`huge_pages` says they are granted (and is at least
    one huge page long); else ``torch.empty``. Its pages are committed as they are written, like
    ``torch.empty``'s; the mapping lives as long as the tensor (and its views)."""
    if nbytes < 0:
        raise ValueError(f"nbytes: a buffer's size is at least 0, got {nbytes}")
    if nbytes < HUGE_PAGE or not huge_pages():
        return torch.empty(nbytes, dtype=torch.uint8)
    try:
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)  # + one page: room to align the start
    except OSError as exc:
        raise MemoryError(f"cannot map {nbytes} bytes for weights: {exc}") from exc
    whole = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping
    start = -whole.data_ptr() % HUGE_PAGE  # a multiple of the small page size: the map starts on one
    # the whole huge pages only: the tail's partial one stays in small pages, so no buffer commits more than it holds
    with contextlib.suppress(OSError):  # a kernel without them refuses the advice: small pages, as torch.empty's
        region.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE * HUGE_PAGE)
    return whole[start:start + nbytes]


def joined_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """The rows of ``parts`` (uint8 [rows, width], one width: a projection's pieces) one after another, in a
    :func:`weight_buffer` (huge pages where granted)."""
    width = parts[0].shape[1]
    total = sum(p.shape[0] for p in parts)
    return torch.cat(parts, out=weight_buffer(total * width).view(total, width))


def in_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` in a :func:`weight_buffer` (same dtype and shape)."""
    flat = t.contiguous().view(-1).view(torch.uint8)
    out = weight_buffer(flat.numel())
    out.copy_(flat)
    return out.view(t.dtype).view(t.shape)
