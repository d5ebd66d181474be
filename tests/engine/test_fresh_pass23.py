"""Pass 23: a request's reported log-probabilities depend on the request only (issue 25, class 2 and 3)."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncinfer.sampler import Sampler, SamplingState
from asyncinfer.sampling_params import SamplingParams
from tests.helpers import AllowTokens

VOCAB = 320


def structured(logprobs: int) -> SamplingState:
    matcher: Any = AllowTokens([93])
    return SamplingState(params=SamplingParams(logprobs=logprobs), prompt_token_ids=[1], matcher=matcher)


def test_a_structured_rows_alternatives_do_not_depend_on_a_neighbours_logprobs() -> None:
    """A grammar that allows one token leaves every other at -inf: ties, which ``torch.topk`` ordered as its
    kernel met them, so the alternatives a row reported (OpenAI's -9999 over HTTP) changed with the largest
    ``logprobs`` of its step: alone ``[93, 0]``, beside a neighbour asking 3 ``[93, 1]``. They are now the
    lowest ids among equal logprobs, whatever the batch."""
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    sampler = Sampler(VOCAB, torch.device("cpu"))
    alone = sampler(logits[:1], [structured(2)]).logprobs[0]
    beside = sampler(logits, [structured(2), SamplingState(params=SamplingParams(logprobs=3), prompt_token_ids=[1])])
    assert alone is not None and beside.logprobs[0] == alone
    assert [t for t, _ in alone.top] == [93, 0] and alone.top[1][1] == float("-inf")
    assert [t for t, _ in sampler(logits[:1], [structured(5)]).logprobs[0].top] == [93, 0, 1, 2, 3]


def test_equal_finite_logprobs_are_ordered_by_id_and_cut_at_the_lowest_ids() -> None:
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, [250, 7, 100]] = 2.0
    logits[0, [300, 9]] = 1.0
    state = SamplingState(params=SamplingParams(logprobs=4), prompt_token_ids=[1])
    top = Sampler(VOCAB, torch.device("cpu"))(logits, [state]).logprobs[0].top
    assert [t for t, _ in top] == [7, 100, 250, 9]


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.lists(st.sampled_from([float("-inf"), -3.0, -1.0, 0.0, 0.5, 2.0]), min_size=24, max_size=24),
                     min_size=1, max_size=4),
       k=st.integers(1, 24), more=st.integers(0, 24))
def test_a_rows_alternatives_are_the_first_of_one_order_whatever_k_and_its_neighbours(rows, k, more) -> None:
    """Logits made of few values (ties everywhere, ``-inf`` included): each row's ``k`` alternatives are the first
    ``k`` of its tokens sorted by logprob, then id, alone or beside other rows, and with a larger ``k`` asked."""
    logits = torch.tensor(rows)
    if torch.isinf(logits).all(dim=1).any():
        return  # no distribution to take logprobs of
    logp = torch.log_softmax(logits, dim=-1)
    big = min(k + more, logits.shape[1])
    together = Sampler._top_alternatives(logp, big)
    for r in range(len(rows)):
        values = logp[r].tolist()
        expected = sorted(range(len(values)), key=lambda t: (-values[t], t))[:k]
        assert [t for t, _ in Sampler._top_alternatives(logp[r:r + 1], k)[0]] == expected
        assert [t for t, _ in together[r][:k]] == expected
        assert [v for _, v in together[r][:k]] == [values[t] for t in expected]
