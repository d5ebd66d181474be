"""Quality gates of the weight formats on the real model (a short run of benchmarks/quality.py).

Every format is measured against plain float32 (``F.linear``) on the same loaded weights:
packed float32 must give exactly float32's greedy tokens, float16 the same greedy tokens on
every prompt, int8 (its default ``quantization_skip``) a teacher-forced top-1 agreement of at
least ``INT8_GATE`` on the held-out text. The numerics do not depend on the CPU model: fbgemm's
float16 kernel is deterministic, and int8's weights stay within +-64 so that no x86 CPU
saturates its int16 sums (tests/models/test_quant.py checks it against exact integer arithmetic).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncinfer.models import load_model
from asyncinfer.models.quality import (
    batched_greedy,
    formatted,
    greedy_match,
    teacher_forced_argmax,
    top1_agreement,
)
from asyncinfer.models.quant import BlockLinear, default_skip
from benchmarks.common import QUESTIONS as CHAT_QUESTIONS

pytestmark = pytest.mark.real_model

HELDOUT = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "heldout.txt"
QUESTIONS = CHAT_QUESTIONS[:8]  # the benchmark's first eight chat questions (benchmarks/common.py)
NEW_TOKENS = 48
TEXT_TOKENS = 768
#: int8's gate: the issue asked for 0.97; per-tensor 8-bit activations cannot reach it on SmolLM2-135M
#: with any skip list that still quantizes most weights (benchmarks/results/quality.json: 0.885 with the
#: default skip list on the whole text; docs/formats.md).
INT8_GATE = 0.85
#: q8_0's gate: the issue's 0.97 for an int8 format (0.974 on the whole text, benchmarks/results/quality.json).
Q8_0_GATE = 0.97
#: activation_dtype="int8"'s gate on the file's own Q4_1 weights, read a token at a time (each step below
#: PANEL_MIN_ROWS rows, where the activations are rounded): 0.927 measured (benchmarks/results/quality_xeon.json); the
#: int16 default: 1.000 the same way.
INT8_ACTIVATIONS_GATE = 0.90
#: activation_dtype="bfloat16"'s gate on the file's own Q4_1 weights, the text read in prefill chunks of 256 tokens
#: (each step from BF16_MIN_ROWS rows multiplies in bfloat16): 0.983 measured on an AMX Xeon (docs/formats.md,
#: "Batched steps"); the int16 default: 1.000 the same way.
BF16_ACTIVATIONS_GATE = 0.97


@pytest.fixture(scope="module")
def reference(real_gguf):
    """The float32 model, its tokenizer, and its own teacher-forced argmax and greedy tokens."""
    torch.manual_seed(0)
    loaded = load_model(real_gguf, torch.float32, "cpu")
    tok = loaded.tokenizer
    text = tok.encode(HELDOUT.read_text(), add_special_tokens=False)[:TEXT_TOKENS]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                  tokenize=False), add_special_tokens=False) for q in QUESTIONS]
    return {"model": loaded.model, "text": text, "prompts": prompts,
            "greedy": batched_greedy(loaded.model, prompts, NEW_TOKENS)}


@pytest.fixture(scope="module")
def teacher_forced_reference(reference) -> torch.Tensor:
    """float32's own teacher-forced argmax over the held-out text: computed once for the q8_0 and int8 gates
    (both compare against it; the reference model is left as it is by :func:`formatted`)."""
    return teacher_forced_argmax(reference["model"], reference["text"])


def test_packed_float32_gives_exactly_float32s_greedy_tokens(reference) -> None:
    packed = formatted(reference["model"], None, pack=True)
    assert batched_greedy(packed, reference["prompts"], NEW_TOKENS) == reference["greedy"]


def test_float16_is_greedy_identical_on_every_prompt(reference) -> None:
    half = formatted(reference["model"], "float16")
    identical, prefix = greedy_match(reference["greedy"], batched_greedy(half, reference["prompts"], NEW_TOKENS))
    assert (identical, prefix) == (1.0, 1.0)


def test_q4_1_holds_float32s_own_weights_and_is_greedy_identical_on_every_prompt(reference) -> None:
    """The file's Q4_1 projections and Q8_0 head, back as blocks: every weight is float32's, and only the
    kernels' int16 activations and summation order differ (benchmarks/results/quality.json)."""
    q4 = formatted(reference["model"], "q4_1")
    layers = [m for m in q4.modules() if isinstance(m, BlockLinear)]
    assert len(layers) == 30 * 4 + 1 and all(layer.lossless for layer in layers)
    identical, prefix = greedy_match(reference["greedy"], batched_greedy(q4, reference["prompts"], NEW_TOKENS))
    assert (identical, prefix) == (1.0, 1.0)
    # One prompt at a time, as a single user's decode runs (int16 activations, asyncinfer.kernels.gemm).
    for prompt, expected in list(zip(reference["prompts"], reference["greedy"]))[:3]:
        assert batched_greedy(q4, [prompt], NEW_TOKENS) == [expected]


def test_q8_0_teacher_forced_top1_agreement(reference, teacher_forced_reference) -> None:
    """The int8 format that meets the issue's 97%: 8-bit weights per block of 32 (rounded again from the
    file's 4-bit ones), float32 activations rounded per block to 16 bits."""
    expected = teacher_forced_reference
    q8 = formatted(reference["model"], "q8_0")
    assert top1_agreement(expected, teacher_forced_argmax(q8, reference["text"])) >= Q8_0_GATE


def test_int8_teacher_forced_top1_agreement(reference, teacher_forced_reference) -> None:
    expected = teacher_forced_reference
    int8 = formatted(reference["model"], "int8", default_skip("int8"))
    agreement = top1_agreement(expected, teacher_forced_argmax(int8, reference["text"]))
    assert agreement >= INT8_GATE, agreement


def test_int8_activations_teacher_forced_top1_agreement_a_token_at_a_time(reference, teacher_forced_reference) -> None:
    """activation_dtype="int8" on the file's Q4_1 blocks: the held-out text read one token a step (the int8
    GEMMs run below PANEL_MIN_ROWS rows only; a prefill of the whole text would never reach them)."""
    int8 = formatted(reference["model"], "q4_1", activation_dtype="int8")
    agreement = top1_agreement(teacher_forced_reference, teacher_forced_argmax(int8, reference["text"], chunk=1))
    assert INT8_ACTIVATIONS_GATE <= agreement < 0.99, agreement  # a real change of numerics, within its gate


def test_bf16_activations_teacher_forced_top1_agreement_in_prefill_chunks(reference, teacher_forced_reference) -> None:
    """activation_dtype="bfloat16" on the file's Q4_1 blocks: the held-out text read in prefill chunks of 256 tokens,
    the steps bfloat16 multiplies (a token a step would take int16's rows)."""
    bf16 = formatted(reference["model"], "q4_1", activation_dtype="bfloat16")
    agreement = top1_agreement(teacher_forced_reference, teacher_forced_argmax(bf16, reference["text"]))
    assert BF16_ACTIVATIONS_GATE <= agreement < 1.0, agreement  # a real change of numerics, within its gate
