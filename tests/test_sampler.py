from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import RepetitionPenaltyLogitsProcessor

from asyncinfer.errors import InvalidParameterError
from asyncinfer.sampler import Sampler, SamplerOutput, SamplingState, TokenLogprobs
from asyncinfer.sampling_params import SamplingParams
from tests.helpers import warpers_kept

CPU = torch.device("cpu")


def state(prompt=(), out=(), **kw) -> SamplingState:
    return SamplingState(params=SamplingParams(**kw), prompt_token_ids=list(prompt), output_token_ids=list(out))


def processed_logprobs(sampler: Sampler, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """The full log_softmax of the processed logits, rebuilt from the top-n logprobs (vocab <= 20)."""
    out = sampler(logits, states)
    rows = []
    for lp in out.logprobs:
        assert lp is not None and len(lp.top) == logits.shape[1]
        row = torch.empty(logits.shape[1])
        for tok, val in lp.top:
            row[tok] = val
        rows.append(row)
    return torch.stack(rows)


# --------------------------------------------------------------------------- greedy


def test_greedy_equals_argmax_fast_path():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    before = logits.clone()
    states = [state() for _ in range(6)]
    assert all(s.plain_greedy for s in states)
    out = Sampler(50, CPU)(logits, states)
    assert isinstance(out, SamplerOutput)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert all(isinstance(t, int) for t in out.token_ids)
    assert out.logprobs == [None] * 6
    assert torch.equal(logits, before)


def test_greedy_rows_in_mixed_batch_are_argmax_and_input_untouched():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 30, generator=g)
    before = logits.clone()
    states = [state(), state(temperature=1.0, seed=3), state(logprobs=2), state(temperature=0.5)]
    out = Sampler(30, CPU)(logits, states)
    am = logits.argmax(-1).tolist()
    assert out.token_ids[0] == am[0] and out.token_ids[2] == am[2]
    assert torch.equal(logits, before)


def test_padded_vocab_columns_never_chosen_and_empty_batch():
    logits = torch.zeros(2, 12)
    logits[:, 11] = 100.0
    logits[0, 3] = 1.0
    sampler = Sampler(10, CPU)
    assert sampler(logits, [state(), state()]).token_ids[0] == 3
    out = sampler(logits, [state(temperature=1.0, seed=1), state(temperature=1.0)])
    assert all(t < 10 for t in out.token_ids)
    assert sampler(torch.zeros(0, 10), []) == SamplerOutput([], [])
    with pytest.raises(ValueError, match=r"logits must be \[len\(states\)=1, vocab\], got \(3, 10\)"):
        sampler(torch.zeros(3, 10), [state()])
    with pytest.raises(ValueError, match="fewer than vocab_size=10"):
        sampler(torch.zeros(1, 9), [state()])


# --------------------------------------------------------------------------- penalties


def test_penalties_match_hand_computed_reference():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0, 3.0]])
    s = state(
        prompt=[0],
        out=[1, 1, 2],
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
        logprobs=5,
    )
    # repetition over prompt+output: 2/2, -1*2, 0.5/2, 0 (unseen), 3 (unseen)
    # then frequency/presence over output only: token 1 (count 2): -2 - 1.0 - 0.25; token 2: 0.25 - 0.5 - 0.25
    expected = torch.tensor([[1.0, -3.25, -0.5, 0.0, 3.0]])
    got = processed_logprobs(Sampler(5, CPU), logits, [s])
    torch.testing.assert_close(got, torch.log_softmax(expected, -1))


def test_presence_and_frequency_ignore_prompt_tokens():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    s = state(prompt=[0, 0, 1], out=[2, 2, 2], presence_penalty=1.0, frequency_penalty=-0.5, logprobs=4)
    expected = torch.tensor([[1.0, 1.0, 1.0 - 1.0 + 1.5, 1.0]])
    got = processed_logprobs(Sampler(4, CPU), logits, [s])
    torch.testing.assert_close(got, torch.log_softmax(expected, -1))


def test_repetition_penalty_equals_transformers_processor_batched():
    g = torch.Generator().manual_seed(2)
    vocab = 20
    logits = torch.randn(3, vocab, generator=g) * 3
    cases = [([1, 2, 3, 3], [4, 19], 1.3), ([], [0, 0, 5], 0.7), ([7] * 5, [], 2.0)]
    states = [state(prompt=p, out=o, repetition_penalty=r, logprobs=vocab) for p, o, r in cases]
    got = processed_logprobs(Sampler(vocab, CPU), logits, states)
    for i, (p, o, r) in enumerate(cases):
        ids = torch.tensor([p + o])
        ref = RepetitionPenaltyLogitsProcessor(penalty=r)(ids, logits[i : i + 1].clone())
        torch.testing.assert_close(got[i : i + 1], torch.log_softmax(ref, -1))


def penalized_reference(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Every row's penalties computed from scratch over its whole prompt and output, in float32 as transformers
    and vLLM define them: repetition over each distinct token of prompt + output, then frequency and presence
    over the output's counts."""
    x = logits.clone()
    vocab = x.shape[1]
    for i, s in enumerate(states):
        p = s.params
        if p.repetition_penalty != 1.0:
            for t in {t for t in s.prompt_token_ids if t < vocab} | set(s.output_token_ids):
                v = x[i, t]
                x[i, t] = v / torch.tensor(p.repetition_penalty) if v > 0 else v * torch.tensor(p.repetition_penalty)
        for t in set(s.output_token_ids):
            count = torch.tensor(float(s.output_token_ids.count(t)))
            x[i, t] -= torch.tensor(p.frequency_penalty) * count + torch.tensor(p.presence_penalty)
    return x


@settings(max_examples=60, deadline=None)
@given(data=st.data(), vocab=st.integers(2, 40))
def test_penalties_kept_up_to_date_step_by_step_equal_the_whole_history_computed_again(data, vocab) -> None:
    """The sampler counts each request's tokens a step at a time (a step's cost does not grow with the output); its
    penalized logits are at every step bit for bit those of the whole prompt and output counted afresh."""
    sampler = Sampler(vocab, CPU)
    tokens = st.integers(0, vocab - 1)
    kinds = [{"repetition_penalty": 1.7}, {"frequency_penalty": 0.4, "presence_penalty": -0.3},
             {"repetition_penalty": 0.6, "frequency_penalty": -1.25}, {"presence_penalty": 2.0}, {}]
    states = [state(prompt=data.draw(st.lists(st.integers(0, vocab + 5), max_size=12)), **kw) for kw in kinds]
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    for _ in range(data.draw(st.integers(1, 8))):
        for s in states:  # the engine appends each step's tokens (here 0 to 4 of them) to the shared list
            s.output_token_ids.extend(data.draw(st.lists(tokens, max_size=4)))
        logits = torch.randn(len(states), vocab, generator=gen) * 3
        rows = [i for i, s in enumerate(states) if s.params.has_penalties]
        got = logits.clone()
        sampler._apply_penalties(got, rows, states)
        assert torch.equal(got, penalized_reference(logits, states))
    for s in states[:4]:
        assert s._counts is not None and s._counts.counted == len(s.output_token_ids)  # counted once, as it grew


def test_penalties_apply_to_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    assert Sampler(3, CPU)(logits, [state(out=[0], presence_penalty=0.5)]).token_ids == [1]
    assert Sampler(3, CPU)(logits, [state(prompt=[0], repetition_penalty=1.2)]).token_ids == [1]
    assert Sampler(3, CPU)(logits, [state(prompt=[0], presence_penalty=0.5)]).token_ids == [0]


# --------------------------------------------------------------------------- filtering


def _kept(x: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(x)).flatten().tolist())


FILTERS = [
    {"top_k": 5},
    {"top_k": 1},
    {"top_p": 0.8},
    {"top_p": 0.3},
    {"min_p": 0.1},
    {"min_p": 0.5},
    {"top_k": 10, "top_p": 0.7},
    {"top_k": 20, "top_p": 0.9, "min_p": 0.05},
    {"top_p": 0.95, "min_p": 0.2},
    {},
    {"top_k": 1000},
]


@pytest.mark.parametrize("seed", range(3))
def test_filters_keep_the_same_sets_as_transformers_warpers(seed):
    g = torch.Generator().manual_seed(seed)
    vocab = 64
    logits = torch.randn(len(FILTERS), vocab, generator=g)
    params = [SamplingParams(temperature=1.0, **f) for f in FILTERS]
    filtered = Sampler._filter(logits.clone(), params)
    for i, p in enumerate(params):
        assert _kept(filtered[i]) == warpers_kept(logits[i], p), FILTERS[i]
        kept = torch.isfinite(filtered[i])
        torch.testing.assert_close(filtered[i][kept], logits[i][kept])  # survivors untouched
    # each filter alone on the whole batch takes the min_p-only / unsorted paths too
    for f in ({"min_p": 0.3}, {"top_k": 3}, {"top_p": 0.5}):
        ps = [SamplingParams(temperature=1.0, **f)] * len(FILTERS)
        filtered = Sampler._filter(logits.clone(), ps)
        for i in range(len(FILTERS)):
            assert _kept(filtered[i]) == warpers_kept(logits[i], ps[i])


def test_sampled_tokens_respect_top_k():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(1, 40, generator=g).expand(300, 40)
    states = [state(temperature=1.5, top_k=3) for _ in range(300)]
    out = Sampler(40, CPU, seed=0)(logits, states)
    top3 = set(torch.topk(logits[0], 3).indices.tolist())
    assert set(out.token_ids) == top3


# --------------------------------------------------------------------------- randomness


def _run_alone_and_in_batch(seed: int, steps: int = 12, vocab: int = 500, device: torch.device = CPU):
    g = torch.Generator().manual_seed(99)
    step_logits = [torch.randn(5, vocab, generator=g).to(device) for _ in range(steps)]
    kw = {"temperature": 0.9, "top_p": 0.95, "top_k": 100, "seed": seed}

    alone = state(**kw)
    sampler_a = Sampler(vocab, device, seed=1)
    for x in step_logits:
        alone.output_token_ids.extend(sampler_a(x[:1], [alone]).token_ids)

    target = state(**kw)
    others = [state(temperature=1.0, seed=7), state(temperature=1.0), state(), state(temperature=0.3, min_p=0.1)]
    sampler_b = Sampler(vocab, device, seed=2)
    for step, x in enumerate(step_logits):
        # the target sits at a different row each step, with others around it
        pos = step % 5
        batch = others[:pos] + [target] + others[pos:]
        rows = torch.cat([x[1 : 1 + pos], x[:1], x[1 + pos :]])
        out = sampler_b(rows, batch)
        target.output_token_ids.append(out.token_ids[pos])
        for s, t in zip(batch, out.token_ids):
            if s is not target:
                s.output_token_ids.append(t)
    return alone.output_token_ids, target.output_token_ids


def test_seeded_request_is_batch_and_position_invariant():
    alone, batched = _run_alone_and_in_batch(seed=1234)
    assert alone == batched
    assert len(set(alone)) > 1  # it really sampled


def test_different_seeds_differ():
    a, _ = _run_alone_and_in_batch(seed=1)
    b, _ = _run_alone_and_in_batch(seed=2)
    assert a != b


def test_seed_creates_generator_lazily():
    s = state(temperature=1.0, seed=5)
    assert s.generator is None
    Sampler(8, CPU)(torch.zeros(1, 8), [s])
    assert isinstance(s.generator, torch.Generator)
    g = state(seed=5)  # greedy: no generator needed
    Sampler(8, CPU)(torch.zeros(1, 8), [g])
    assert g.generator is None


def _chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))


@pytest.mark.parametrize("seeded", [False, True])
def test_temperature_sampling_matches_softmax(seeded):
    logits = torch.tensor([1.0, 0.5, 0.0, -1.0])
    temperature = 0.7
    n = 4000
    if seeded:
        states = [state(temperature=temperature, seed=i) for i in range(n)]
    else:
        states = [state(temperature=temperature) for _ in range(n)]
    out = Sampler(4, CPU, seed=123)(logits.expand(n, 4), states)
    counts = [out.token_ids.count(t) for t in range(4)]
    probs = torch.softmax(logits / temperature, -1).tolist()
    # df = 3; P(chi2 > 16.27) = 0.001. Seeded, so the outcome is fixed anyway.
    assert _chi_square(counts, probs) < 16.27, (counts, probs)


def test_unseeded_sampler_seed_is_reproducible():
    logits = torch.randn(64, 10, generator=torch.Generator().manual_seed(5))
    a = Sampler(10, CPU, seed=9)(logits, [state(temperature=1.0) for _ in range(64)]).token_ids
    b = Sampler(10, CPU, seed=9)(logits, [state(temperature=1.0) for _ in range(64)]).token_ids
    c = Sampler(10, CPU, seed=10)(logits, [state(temperature=1.0) for _ in range(64)]).token_ids
    assert a == b
    assert a != c  # the seed matters...
    assert a != logits.argmax(-1).tolist()  # ...because these rows really were sampled


# --------------------------------------------------------------------------- min_tokens / eos


def test_min_tokens_blocks_eos_and_stop_tokens():
    eos = 3
    logits = torch.tensor([[0.0, 1.0, 2.0, 10.0, 9.0]])  # eos, then stop id 4, are the favourites
    sampler = Sampler(5, CPU, eos_token_ids=(eos,))
    s = state(min_tokens=2, stop_token_ids=[4])
    assert sampler(logits, [s]).token_ids == [2]  # eos and 4 masked
    s.output_token_ids.append(2)
    assert sampler(logits, [s]).token_ids == [2]
    s.output_token_ids.append(2)
    assert sampler(logits, [s]).token_ids == [eos]  # min_tokens reached
    # sampling rows too: eos can never be drawn before min_tokens
    rows = [state(temperature=1.0, min_tokens=1) for _ in range(200)]
    out = sampler(logits.expand(200, 5), rows)
    assert eos not in out.token_ids


def test_ignore_eos_does_not_mask_in_sampler():
    logits = torch.tensor([[0.0, 5.0]])
    assert Sampler(2, CPU, eos_token_ids=(1,))(logits, [state(ignore_eos=True)]).token_ids == [1]


# --------------------------------------------------------------------------- logprobs


def test_logprobs_values_and_shapes():
    g = torch.Generator().manual_seed(6)
    vocab = 30
    logits = torch.randn(4, vocab, generator=g)
    states = [
        state(logprobs=3),
        state(temperature=2.0, top_k=2, logprobs=5, seed=1),
        state(),
        state(temperature=1.0, logprobs=0),
    ]
    out = Sampler(vocab, CPU)(logits, states)
    ref = torch.log_softmax(logits, -1)  # before temperature / filtering
    assert out.logprobs[2] is None
    for i, n in ((0, 3), (1, 5), (3, 0)):
        lp = out.logprobs[i]
        assert isinstance(lp, TokenLogprobs)
        assert lp.token_id == out.token_ids[i]
        assert math.isclose(lp.logprob, ref[i, lp.token_id].item(), rel_tol=1e-5, abs_tol=1e-6)
        assert len(lp.top) == n
        vals, idx = torch.topk(ref[i], n) if n else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert [t for t, _ in lp.top] == idx.tolist()
        for (_, v), rv in zip(lp.top, vals.tolist()):
            assert math.isclose(v, rv, rel_tol=1e-5, abs_tol=1e-6)
        assert all(isinstance(t, int) and isinstance(v, float) for t, v in lp.top)
    assert out.logprobs[0].token_id == logits[0].argmax().item()
    assert out.logprobs[1].token_id in torch.topk(logits[1], 2).indices.tolist()


def test_logprobs_after_penalties():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    s = state(out=[0], presence_penalty=2.0, logprobs=3)
    out = Sampler(3, CPU)(logits, [s])
    ref = torch.log_softmax(torch.tensor([0.0, 1.0, 0.0]), -1)
    assert out.token_ids == [1]
    assert math.isclose(out.logprobs[0].logprob, ref[1].item(), rel_tol=1e-5)


def test_tiny_temperature_is_finite_and_argmax():
    logits = torch.tensor([[0.0, 1.0, 3.0, -2.0]] * 3)
    states = [
        state(temperature=1e-30, seed=1),
        state(temperature=1e-9, top_p=0.5),
        state(temperature=1e-7, min_p=0.5),
    ]
    assert Sampler(4, CPU)(logits, states).token_ids == [2, 2, 2]


# --------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_paths():
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 64, generator=g)
    sampler = Sampler(64, dev, eos_token_ids=(0,))
    assert sampler(logits.to(dev), [state() for _ in range(4)]).token_ids == logits.argmax(-1).tolist()
    penalised = {"prompt": [1, 2], "out": [3, 3], "repetition_penalty": 1.5, "frequency_penalty": 0.3, "logprobs": 4}
    states = [
        state(**penalised),
        state(temperature=0.8, top_k=10, top_p=0.9, min_p=0.05, seed=3, logprobs=0),
        state(temperature=1.0, min_tokens=5),
        state(),
    ]
    out = sampler(logits.to(dev), states)
    cpu = Sampler(64, CPU, eos_token_ids=(0,))(logits[:1], [state(**penalised)])
    assert out.token_ids[0] == cpu.token_ids[0]
    assert [t for t, _ in out.logprobs[0].top] == [t for t, _ in cpu.logprobs[0].top]
    assert out.token_ids[2] != 0 and out.token_ids[3] == logits[3].argmax().item()
    alone, batched = _run_alone_and_in_batch(seed=11, device=dev)
    assert alone == batched


def test_the_steps_greedy_ids_serve_plain_greedy_rows_only():
    """A step whose kernel computed each row's argmax hands it over (``greedy_ids``): a batch of plain greedy
    rows takes it as it is; with a row of any other parameter (a temperature, min_tokens masking EOS, a
    penalty, logprobs) every row is sampled from the logits; ids of the wrong count are refused by name."""
    sampler = Sampler(vocab_size=8, device="cpu", eos_token_ids=(3,), seed=0)
    logits = torch.zeros(2, 8)
    logits[:, 3] = 5.0  # both rows' argmax: 3, the EOS token
    logits[:, 5] = 4.0
    greedy = [state(temperature=0), state(temperature=0)]
    assert sampler(logits, greedy, greedy_ids=[3, 3]).token_ids == [3, 3]
    assert sampler(logits, greedy, greedy_ids=[6, 7]).token_ids == [6, 7]  # taken as given
    assert sampler(logits, greedy, greedy_ids=None).token_ids == [3, 3]
    masked = sampler(logits, [state(temperature=0), state(temperature=0, min_tokens=2)], greedy_ids=[6, 7])
    assert masked.token_ids == [3, 5]  # min_tokens masks EOS in row 1; neither row takes the given ids
    penalised = sampler(logits, [state(temperature=0), state(temperature=0, repetition_penalty=2.0)],
                        greedy_ids=[6, 7])
    assert penalised.token_ids == [3, 3]
    logged = sampler(logits, [state(temperature=0), state(temperature=0, logprobs=1)], greedy_ids=[6, 7])
    assert logged.token_ids == [3, 3] and logged.logprobs[0] is None and logged.logprobs[1].token_id == 3
    hot = sampler(torch.full((2, 8), -1e4).index_fill_(1, torch.tensor([4]), 0.0),
                  [state(temperature=0), state(temperature=1.0, seed=1)], greedy_ids=[6, 7])
    assert hot.token_ids == [4, 4]  # every other token is e^-10000 less likely: the draw is 4, not the id
    for wrong in ([3], 5, "33"):
        with pytest.raises(InvalidParameterError) as err:
            sampler(logits, greedy, greedy_ids=wrong)
        assert err.value.parameter == "greedy_ids"


def test_greedy_logits_of_any_layout_are_sampled_once_the_kernels_are_loaded():
    """The one-pass argmax takes rows that follow each other; other layouts (an expanded row, overlapping
    rows) fall back to torch's argmax, whether or not asyncinfer's kernels are loaded."""
    from asyncinfer import kernels

    if kernels.available():  # loads them: the sampler's kernel path is then live
        assert kernels.loaded()
    row = torch.randn(16)
    sampler = Sampler(16, "cpu")
    greedy = [state(temperature=0)] * 3
    assert sampler(row.expand(3, 16), greedy).token_ids == [int(row.argmax())] * 3
    overlapping = torch.randn(40).as_strided((3, 16), (8, 1))
    assert sampler(overlapping, greedy).token_ids == overlapping.argmax(-1).tolist()
