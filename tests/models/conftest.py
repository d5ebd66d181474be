"""Shared helpers for tests/models: tiny random HF models and a minimal paged-cache driver.

They live here (exposed as fixtures) because the project runs pytest with
``--import-mode=importlib``, where test modules cannot import sibling helpers.

``PagedRunner`` plays the engine's part in the smallest way possible: it hands
out shuffled block ids, keeps each sequence's block table and length, builds
the step's metadata through an attention backend and runs one forward per step.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from asyncinfer.cache.spec import KVCacheSpec
from asyncinfer.models import AttentionBackend, LlamaForCausalLM, load_model, select_attention_backend

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_hf_config(kind: str):
    """A tiny transformers config; ``kind`` picks the architecture/rope variant."""
    if kind == "llama":
        return LlamaConfig(**TINY, tie_word_embeddings=False)
    if kind == "llama3_rope":
        return LlamaConfig(
            **TINY,
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
        return LlamaConfig(**TINY, rope_scaling={"rope_type": "linear", "factor": 2.0})
    if kind == "qwen2":
        return Qwen2Config(**TINY, tie_word_embeddings=True)
    if kind == "mistral":
        return MistralConfig(**TINY, sliding_window=None, tie_word_embeddings=False)
    raise ValueError(kind)


def tiny_hf_model(kind: str, seed: int = 0):
    """A tiny HF model with weights large enough that logits are well spread.

    HF's default init (std 0.02, zero biases, unit norms) gives near-uniform
    logits; random norms and biases also exercise those code paths.
    """
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(kind), attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    return model.eval()


class PagedRunner:
    """Drive ``LlamaForCausalLM`` step by step over a shuffled paged cache."""

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

    def step(self, work: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """Run one step; ``work`` is (seq_id, new tokens), decodes first.

        Returns each sequence's logits for its new tokens, [query_len, vocab] each.
        """
        input_ids, positions, slots = [], [], []
        query_lens, context_lens, tables = [], [], []
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
            self.lens[seq] = start + len(tokens)
            query_lens.append(len(tokens))
            context_lens.append(self.lens[seq])
            tables.append(list(table))
        meta = self.backend.build_metadata(query_lens=query_lens, context_lens=context_lens, block_tables=tables,
                                           slot_mapping=slots, block_size=self.block_size, device=self.device)
        ids = torch.tensor(input_ids, device=self.device)
        pos = torch.tensor(positions, device=self.device)
        with torch.inference_mode():
            hidden = self.model(ids, pos, self.kv_caches, meta)
            logits = self.model.compute_logits(hidden).cpu()  # all rows: tests compare every position
        return list(logits.split(query_lens))


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    """Reference logits [len(tokens), vocab] from a full, uncached HF forward."""
    with torch.inference_mode():
        return hf_model(torch.tensor([tokens])).logits[0].float()


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """Factory: kind -> (hf_model, our LoadedModel) on the same saved weights, cached per module."""
    cache: dict[str, tuple] = {}

    def make(kind: str):
        if kind not in cache:
            hf = tiny_hf_model(kind)
            path = tmp_path_factory.mktemp(f"tiny_{kind}")
            hf.save_pretrained(path, safe_serialization=True)
            cache[kind] = (hf, load_model(path, torch.float32, torch.device("cpu")))
        return cache[kind]

    return make


@pytest.fixture
def paged_runner():
    """The ``PagedRunner`` class."""
    return PagedRunner


@pytest.fixture
def reference_logits():
    """``hf_logits(hf_model, tokens)``: full uncached HF forward."""
    return hf_logits


@pytest.fixture
def make_tiny_hf():
    """``tiny_hf_model(kind, seed=0)``."""
    return tiny_hf_model
