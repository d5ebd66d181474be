"""Our model vs transformers on the same weights: prefill, chunked prefill, mixed batches, greedy decode."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from tests.helpers import PagedRunner, hf_logits

ATOL = 1e-4
KINDS = ["llama", "qwen2", "mistral", "llama3_rope", "linear_rope", "qwen3", "qwen3_yarn", "phi3"]


def random_tokens(n: int, seed: int, vocab: int = 256) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


@pytest.mark.parametrize("kind", KINDS)
def test_single_prefill_matches_hf(tiny_pair, kind):
    hf, ours = tiny_pair(kind)
    tokens = random_tokens(45, seed=1)  # > original_max_position_embeddings of llama3_rope and qwen3_yarn
    (logits,) = PagedRunner(ours.model).step([(0, tokens)])
    torch.testing.assert_close(logits, hf_logits(hf, tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "phi3"])
def test_chunked_prefill_on_cached_prefix(tiny_pair, kind):
    hf, ours = tiny_pair(kind)
    tokens = random_tokens(30, seed=2)
    expected = hf_logits(hf, tokens)
    runner = PagedRunner(ours.model, block_size=4, seed=3)
    start = 0
    for size in (7, 5, 9, 1, 8):  # chunks straddle block boundaries; one is a 1-token "decode"
        (logits,) = runner.step([(0, tokens[start : start + size])])
        torch.testing.assert_close(logits, expected[start : start + size], atol=ATOL, rtol=0)
        start += size


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "phi3"])
def test_mixed_batch_of_decodes_and_prefills(tiny_pair, kind):
    """Several sequences in one flattened batch, decodes first, shuffled block ids."""
    hf, ours = tiny_pair(kind)
    seqs = {i: random_tokens(n, seed=10 + i) for i, n in enumerate((14, 6, 17, 9))}
    expected = {i: hf_logits(hf, toks) for i, toks in seqs.items()}
    runner = PagedRunner(ours.model, num_blocks=40, block_size=4, seed=4)
    # (seq, start, end) per step; each step lists decodes (1 token) before prefills.
    schedule = [
        [(0, 0, 10), (1, 0, 3), (2, 0, 6)],
        [(0, 10, 11), (1, 3, 4), (2, 6, 13), (3, 0, 5)],  # 2 decodes + prefix chunk + fresh prefill
        [(0, 11, 12), (1, 4, 5), (3, 5, 6), (2, 13, 17)],  # 3 decodes + last chunk
        [(0, 12, 13), (1, 5, 6), (3, 6, 9)],
    ]
    for step in schedule:
        results = runner.step([(seq, seqs[seq][a:b]) for seq, a, b in step])
        for (seq, a, b), logits in zip(step, results):
            torch.testing.assert_close(logits, expected[seq][a:b], atol=ATOL, rtol=0, msg=f"seq {seq} [{a}:{b}]")


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "qwen3_yarn", "phi3"])
def test_greedy_decode_matches_generate(tiny_pair, kind):
    hf, ours = tiny_pair(kind)
    prompts = [random_tokens(11, seed=20), random_tokens(4, seed=21), random_tokens(7, seed=22)]
    max_new = 12
    with torch.inference_mode():
        reference = [
            hf.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False, pad_token_id=0)[0, len(p) :].tolist()
            for p in prompts
        ]
    assert sum(map(len, reference)) > 2 * max_new  # not just early eos
    runner = PagedRunner(ours.model, block_size=4, seed=5)
    results = runner.step([(i, p) for i, p in enumerate(prompts)])  # all prompts in one step
    generated = {i: [int(r[-1].argmax())] for i, r in enumerate(results)}
    for _ in range(max_new - 1):  # then all sequences decode together
        results = runner.step([(i, toks[-1:]) for i, toks in generated.items()])
        for i, r in enumerate(results):
            generated[i].append(int(r[-1].argmax()))
    for i, ref in enumerate(reference):
        # HF stops at eos; our loop doesn't, so compare up to HF's length.
        assert generated[i][: len(ref)] == ref, f"prompt {i}"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "phi3"])
def test_cuda_mixed_batch(tiny_pair, kind, dtype):
    hf, ours = tiny_pair(kind)
    model = copy.deepcopy(ours.model).to("cuda", dtype)
    seqs = {i: random_tokens(n, seed=30 + i) for i, n in enumerate((9, 5, 12))}
    runner = PagedRunner(model, block_size=4, seed=6, device="cuda")
    runner.step([(0, seqs[0][:8]), (1, seqs[1][:4])])
    results = runner.step([(0, seqs[0][8:]), (1, seqs[1][4:]), (2, seqs[2])])
    atol = 1e-3 if dtype == torch.float32 else 0.15  # TF32-free fp32; bf16 only sanity-checked
    for (seq, start), logits in zip(((0, 8), (1, 4), (2, 0)), results):
        torch.testing.assert_close(logits, hf_logits(hf, seqs[seq])[start:], atol=atol, rtol=0)


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_float32_rms_norm_is_bit_identical_to_the_reference_steps(rows):
    """``rms_norm`` takes torch's own op in float32: the same bits as transformers' steps."""
    from asyncinfer.models.layers import rms_norm

    torch.manual_seed(rows)
    x, weight = torch.randn(rows, 576) * 3, torch.randn(576)
    reference = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert torch.equal(rms_norm(x, weight, 1e-5), reference)
    half = x.to(torch.bfloat16)  # other dtypes: computed in float32, returned in their own
    assert rms_norm(half, weight.to(torch.bfloat16), 1e-5).dtype == torch.bfloat16
