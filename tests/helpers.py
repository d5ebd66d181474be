"""Helpers shared by the test suite: import them with ``from tests.helpers import ...``.

pyproject.toml puts the repository root on ``sys.path`` (``pythonpath = ["."]``), so
``tests`` is importable as a namespace package under ``--import-mode=importlib``.
Fixtures (session resources such as ``tiny_models`` or ``real_gguf``) stay in the
conftest files; plain code lives here.

- Tiny random transformers models: :func:`tiny_hf_config`, :func:`tiny_hf_model`.
- References from transformers: :func:`hf_logits`, :func:`hf_greedy`.
- :class:`PagedRunner`: our model driven step by step over a shuffled paged cache.
- Engine tests: :data:`ENGINE_BASE`, :func:`random_prompts`, :func:`greedy`.
- Scheduler tests: :func:`schedule_and_apply`, :data:`CPU_COST`; broken plugins the conformance
  suites must catch: :class:`QueuesForkedSamples`, :class:`CountsRequestsNotSeats`.
- :data:`SMOLLM2`: the default model's config, for size arithmetic without loading it.
- :func:`loaded_bytes`: the bytes a loaded model holds, its weight-format layers included.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config

from asyncinfer.cache.spec import KVCacheSpec
from asyncinfer.lab import StepCostModel
from asyncinfer.models import AttentionBackend, LlamaForCausalLM, ModelConfig, select_attention_backend
from asyncinfer.models.decode_backends import StepBatch
from asyncinfer.request import Request, RequestStatus
from asyncinfer.sampling_params import SamplingParams
from asyncinfer.schedulers import FIFOScheduler, Scheduler
from asyncinfer.step import apply_step

# ---- tiny random transformers models ---------------------------------------

TINY = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
"""The tiny decoder's shape: 2 layers, 4 query heads sharing 2 KV heads of 16 dims."""


def tiny_hf_config(kind: str, **overrides: Any):
    """A tiny transformers config; ``kind`` picks the architecture/rope variant, ``overrides``
    replace fields of :data:`TINY` (e.g. ``vocab_size``).

    Kinds: ``llama`` (untied head), ``llama3_rope``, ``linear_rope``, ``qwen2`` (tied head,
    q/k/v bias), ``mistral``, ``qwen3`` (per-head q/k norm, an explicit head_dim of 32: q/k/v
    wider than the hidden size), ``phi3`` (fused qkv and gate_up projections in the checkpoint).
    """
    fields = {**TINY, **overrides}
    if kind == "llama":
        return LlamaConfig(**fields, tie_word_embeddings=False)
    if kind == "llama3_rope":
        return LlamaConfig(
            **fields,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
    if kind == "linear_rope":
        return LlamaConfig(**fields, rope_scaling={"rope_type": "linear", "factor": 2.0})
    if kind == "qwen2":
        return Qwen2Config(**fields, tie_word_embeddings=True)
    if kind == "mistral":
        return MistralConfig(**fields, sliding_window=None, tie_word_embeddings=False)
    if kind == "qwen3":
        return Qwen3Config(**{"head_dim": 32, **fields}, tie_word_embeddings=False)
    if kind == "phi3":
        # Phi3Config's default pad id (32000) lies past a tiny vocabulary.
        return Phi3Config(**{"pad_token_id": 0, **fields}, tie_word_embeddings=False)
    raise ValueError(kind)


def tiny_hf_model(kind: str, seed: int = 0, **overrides: Any):
    """A tiny HF model (eval mode, eager attention) with weights large enough that logits are well spread.

    HF's default init (std 0.02, zero biases, unit norms) gives near-uniform
    logits; random norms and biases also exercise those code paths. The same
    ``kind``, ``seed`` and ``overrides`` always give the same weights.
    """
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(kind, **overrides), attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    return model.eval()


# ---- references from transformers --------------------------------------------


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    """Reference logits [len(tokens), vocab] from a full, uncached HF forward."""
    with torch.inference_mode():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """Reference greedy continuation of ``prompt``: exactly ``n`` tokens from transformers' ``generate()``."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False)
    return out[0, len(prompt):].tolist()


# ---- our model over a paged cache, without the engine --------------------------


class PagedRunner:
    """Drive ``LlamaForCausalLM`` step by step over a shuffled paged cache.

    It plays the engine's part in the smallest way possible: it hands out
    shuffled block ids, keeps each sequence's block table and length, builds the
    step's metadata through an attention backend and runs one forward per step.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int = 64,
        block_size: int = 4,
        seed: int = 0,
        device: str = "cpu",
        backend: AttentionBackend | None = None,
    ) -> None:
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        self.backend = backend or select_attention_backend(self.device)
        dtype = model.embed_tokens.weight.dtype
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)  # non-contiguous, unordered block ids
        spec = KVCacheSpec.from_model_config(cfg, block_size=block_size, dtype=dtype, device=self.device)
        shape = spec.layer_shape(num_blocks)
        gen = torch.Generator().manual_seed(seed)
        # Stale (finite) data in unused slots must be masked out, so don't start from zeros.
        self.kv_caches = [
            tuple((torch.randn(shape, generator=gen) * 10).to(self.device, dtype) for _ in range(2))
            for _ in range(cfg.num_layers)
        ]
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, work: list[tuple[int, list[int]]], last_only: bool = False) -> list[torch.Tensor]:
        """Run one step; ``work`` is (seq_id, new tokens), decodes first.

        Returns each sequence's logits for its new tokens, [query_len, vocab] each; with
        ``last_only``, for its last token only ([1, vocab]), the rows the engine's runner
        projects (the int8 head quantizes its input per tensor, so the rows matter there).
        """
        ids, pos, meta, query_lens = self.inputs(work)
        with torch.inference_mode():
            hidden = self.model(ids, pos, self.kv_caches, meta)
            if last_only:
                last = torch.tensor(query_lens, device=self.device).cumsum(0) - 1
                return list(self.model.compute_logits(hidden.index_select(0, last)).cpu().split(1))
            logits = self.model.compute_logits(hidden).cpu()  # all rows: tests compare every position
        return list(logits.split(query_lens))

    def inputs(self, work: list[tuple[int, list[int]]]) -> tuple[torch.Tensor, torch.Tensor, Any, list[int]]:
        """Take the blocks of a step's ``work`` (as :meth:`step` does) and return its model inputs: token
        ids, positions, attention metadata and each sequence's query length."""
        batch = self.step_batch(work)
        meta = self.backend.build_metadata(query_lens=batch.query_lens, context_lens=batch.context_lens,
                                           block_tables=batch.block_tables, slot_mapping=batch.slot_mapping,
                                           block_size=self.block_size, device=self.device)
        ids = torch.tensor(batch.input_ids, device=self.device)
        pos = torch.tensor(batch.positions, device=self.device)
        return ids, pos, meta, batch.query_lens

    def step_batch(self, work: list[tuple[int, list[int]]], last_only: bool = False) -> StepBatch:
        """Take the blocks of a step's ``work`` and return it as a decode backend takes it: every token's
        row sampled, or with ``last_only`` each sequence's last one (as the engine's runner samples)."""
        input_ids, positions, slots = [], [], []
        query_lens, context_lens, tables, rows = [], [], [], []
        for seq, tokens in work:
            table = self.tables.setdefault(seq, [])
            start = self.lens.get(seq, 0)
            for j, tok in enumerate(tokens):
                pos = start + j
                if pos // self.block_size == len(table):
                    table.append(self.free.pop())
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
                positions.append(pos)
                input_ids.append(tok)
                if not last_only or j == len(tokens) - 1:
                    rows.append(len(input_ids) - 1)
            self.lens[seq] = start + len(tokens)
            query_lens.append(len(tokens))
            context_lens.append(self.lens[seq])
            tables.append(list(table))
        return StepBatch(input_ids, positions, slots, query_lens, context_lens, tables, rows)

    def greedy(self, seq: int, prompt: list[int], n: int) -> list[int]:
        """``n`` greedy tokens for ``prompt`` as sequence ``seq``, alone: one prefill step, then one
        decode step a token, projecting only the rows the engine projects."""
        (logits,) = self.step([(seq, prompt)], last_only=True)
        tokens = [int(logits[0].argmax())]
        while len(tokens) < n:
            (logits,) = self.step([(seq, tokens[-1:])], last_only=True)
            tokens.append(int(logits[0].argmax()))
        return tokens


# ---- engine tests ------------------------------------------------------------------

ENGINE_BASE = {"kv_cache_memory": 4 * 1024 * 1024, "max_model_len": 256, "dtype": "float32", "device": "cpu"}
"""Options for a small CPU float32 engine over a tiny model: 4 MiB of KV cache, 256-token context."""


def random_prompts(n: int, seed: int = 0, max_len: int = 40, vocab: int = 320) -> list[list[int]]:
    """``n`` prompts of 3 to ``max_len - 1`` token ids drawn from [3, vocab), the same for the same seed."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, max_len))] for _ in range(n)]


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    """Greedy sampling of exactly ``max_tokens`` tokens (``ignore_eos``); ``kw`` adds other parameters."""
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


# ---- scheduler tests -----------------------------------------------------------------


def schedule_and_apply(sched: Scheduler, token_id: int = 7) -> dict[str, int]:
    """Schedule one step and apply it as the core does, every sampled token being ``token_id``;
    return the step's ``num_scheduled_tokens``."""
    out = sched.schedule()
    apply_step(sched, out, token_id)
    return out.num_scheduled_tokens


CPU_COST = StepCostModel({"const": 0.061, "tokens": 0.00248, "sampled": 0.0, "prefill_seqs": 0.00247,
                          "decode_keys": 2.14e-05, "prefill_keys": 9.3e-07})
"""The shipped SmolLM2-135M CPU cost model's coefficients, pinned (rounded) so that a
recalibration on another machine does not move the tests that use it."""

# ---- the default model's shapes ----------------------------------------------------

SMOLLM2 = ModelConfig(
    architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
    num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, rope_scaling=None,
    max_position_embeddings=8192, tie_word_embeddings=True, attention_bias=False, bos_token_id=1,
    eos_token_ids=(2,),
)
"""SmolLM2-135M-Instruct's config (the default model), written out by hand from its config.json."""


def loaded_bytes(model: torch.nn.Module) -> int:
    """The bytes the loaded model holds: float parameters plus what the format layers keep (int8 weights and
    scales, float16 weights, oneDNN-packed float32 weights; tests/models/test_quant.py reads them back)."""
    from asyncinfer.models.quant import FormatLinear

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total + sum(m.nbytes for m in model.modules() if isinstance(m, FormatLinear))


class QueuesForkedSamples(FIFOScheduler):
    """Broken: forked samples (which hold the prompt's blocks) queue behind the head instead of
    joining the running set, as before issue 10."""

    def add_forked(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.add_request(request)


class CountsRequestsNotSeats(FIFOScheduler):
    """Broken: admits while fewer than max_num_seqs requests run, whatever their samples will add."""

    def has_seats(self, request: Request) -> bool:
        return self.num_running < self.config.max_num_seqs
