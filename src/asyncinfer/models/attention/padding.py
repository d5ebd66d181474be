"""The SDPA backend's decode padding, in plain Python (no torch).

It lives apart from ``sdpa.py`` so that the policy lab can count the same
padded keys as the engine (``lab.cost.StepShape.decode_keys``) without loading
a kernel; :class:`~asyncinfer.models.attention.sdpa.SdpaBackend` exposes it as
its ``decode_padding``. :func:`flat_padded_tables` is the block tables' one
padded layout, for the backend's tensors and the runner's one-call decode step.
"""

from __future__ import annotations

from collections.abc import Sequence


def pad_to_longest_block(context_lens: Sequence[int], block_size: int) -> int:
    """Keys beyond the real contexts when every decode is padded to the longest one, rounded up to whole blocks.

    The SDPA path gathers the same number of blocks for every decode of a step
    (one batched call), so each decode computes ``ceil(max / block_size) * block_size``
    keys of which only its own context is real. ``[]`` pads nothing.
    """
    if not context_lens:
        return 0
    span = -(-max(context_lens) // block_size) * block_size
    return span * len(context_lens) - sum(context_lens)


def flat_padded_tables(block_tables: Sequence[Sequence[int]]) -> tuple[int, list[int]]:
    """The block tables right-padded with block 0 to the widest one, row after row: ``(width, flat)``
    (a padded entry is never read: each sequence reads only its own context's blocks)."""
    width = max((len(table) for table in block_tables), default=0)
    flat: list[int] = []
    for table in block_tables:
        flat += table
        if len(table) < width:
            flat += [0] * (width - len(table))
    return width, flat
