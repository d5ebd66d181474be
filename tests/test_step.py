"""One step's bookkeeping: what a decode is."""

from __future__ import annotations

from asyncinfer.request import Request
from asyncinfer.sampling_params import SamplingParams


def make(prompt_len: int, *, computed: int, outputs: int = 0) -> Request:
    request = Request("r", list(range(prompt_len)), SamplingParams(max_tokens=8), arrival_time=0.0)
    request.output_token_ids.extend([7] * outputs)
    request.num_computed_tokens = computed
    return request


def test_a_decode_computes_the_last_sampled_token() -> None:
    assert make(5, computed=5, outputs=1).is_decode  # first token sampled: feed it back
    assert make(5, computed=8, outputs=4).is_decode
    assert make(5, computed=7, outputs=3).num_uncomputed_tokens == 1
    assert make(5, computed=7, outputs=3).is_decode


def test_prompt_work_is_never_a_decode_even_one_token_long() -> None:
    assert not make(5, computed=0).is_decode
    assert not make(5, computed=4).is_decode  # last prompt token (a chunk or a prefix-cache hit left it)
    assert not make(1, computed=0).is_decode  # a one-token prompt


def test_recomputation_is_prefill_until_only_the_last_token_is_left() -> None:
    assert not make(5, computed=0, outputs=3).is_decode  # just preempted
    assert not make(5, computed=6, outputs=3).is_decode  # two tokens left
    assert make(5, computed=7, outputs=3).is_decode
