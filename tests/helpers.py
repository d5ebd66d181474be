"""Helpers shared by the test suite: import them with ``from tests.helpers import ...``.

pyproject.toml puts the repository root on ``sys.path`` (``pythonpath = ["."]``), so
``tests`` is importable as a namespace package under ``--import-mode=importlib``.
Fixtures (session resources such as ``tiny_models`` or ``real_gguf``) stay in the
conftest files; plain code lives here.

- Tiny random transformers models: :func:`tiny_hf_config`, :func:`tiny_hf_model`; a tiny Gemma as
  llama.cpp writes its GGUF: :func:`write_gemma_gguf` (:func:`gguf_names` maps a weight map's names).
- References from transformers: :func:`hf_logits`, :func:`hf_greedy`.
- :class:`PagedRunner`: our model driven step by step over a shuffled paged cache.
- Engine tests: :data:`ENGINE_BASE`, :func:`random_prompts`, :func:`greedy`.
- Scheduler tests: :func:`schedule_and_apply`, :data:`CPU_COST`; broken plugins the conformance
  suites must catch: :class:`QueuesForkedSamples`, :class:`CountsRequestsNotSeats`.
- :data:`SMOLLM2`: the default model's config, for size arithmetic without loading it.
- :func:`loaded_bytes`: the bytes a loaded model holds, its weight-format layers included.
- Hostile numbers: :class:`Posing` (an int) and :class:`PosingFloat` that compare as another number.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

from asyncinfer.cache.spec import KVCacheSpec
from asyncinfer.lab import StepCostModel
from asyncinfer.models import AttentionBackend, LlamaForCausalLM, ModelConfig, select_attention_backend
from asyncinfer.models.decode_backends import StepBatch
from asyncinfer.request import Request, RequestStatus
from asyncinfer.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS, SamplingParams
from asyncinfer.schedulers import FIFOScheduler, Scheduler
from asyncinfer.step import apply_step

if TYPE_CHECKING:
    from typing_extensions import Self

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

    Kinds: ``llama`` (untied head), ``llama3_rope``, ``linear_rope``, ``qwen3_yarn``, ``qwen2`` (tied head,
    q/k/v bias), ``mistral``, ``qwen3`` (per-head q/k norm, an explicit head_dim of 32: q/k/v
    wider than the hidden size), ``phi3`` (fused qkv and gate_up projections in the checkpoint); with a
    sliding window of :data:`TINY_WINDOW` tokens: ``mistral_window`` and ``qwen2_window_all`` (every layer),
    ``qwen2_window`` and ``qwen3_window`` (the second layer only), ``gemma2`` (layer 0 sliding, 1 full; a ``query_pre_attn_scalar`` that is not
    ``head_dim``; attention and final logits soft-capped low enough to bite) and ``gemma3`` (layers
    sliding, full, sliding; q/k norms; its own rope base on the sliding layers and linear rope scaling on
    the full one).
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
    if kind == "mistral_window":
        return MistralConfig(**fields, sliding_window=TINY_WINDOW, tie_word_embeddings=False)
    if kind == "qwen3_window":
        return Qwen3Config(**{"head_dim": 32, **fields}, tie_word_embeddings=False, use_sliding_window=True,
                           sliding_window=TINY_WINDOW, max_window_layers=1)
    if kind == "qwen2_window":
        return Qwen2Config(**fields, tie_word_embeddings=True, use_sliding_window=True, sliding_window=TINY_WINDOW,
                           max_window_layers=1)
    if kind == "qwen2_window_all":
        return Qwen2Config(**fields, tie_word_embeddings=True, use_sliding_window=True, sliding_window=TINY_WINDOW,
                           max_window_layers=0)
    if kind == "gemma2":
        return Gemma2Config(**{"head_dim": 16, "pad_token_id": 0, **fields}, query_pre_attn_scalar=24,
                            sliding_window=TINY_WINDOW, attn_logit_softcapping=2.0, final_logit_softcapping=4.0)
    if kind == "gemma3":
        fields = {"head_dim": 16, "pad_token_id": 0, **fields, "num_hidden_layers": overrides.get("num_hidden_layers", 3)}
        return Gemma3TextConfig(
            **fields, query_pre_attn_scalar=16, sliding_window=TINY_WINDOW,
            layer_types=[("sliding_attention", "full_attention")[i % 3 == 1] for i in range(fields["num_hidden_layers"])],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}},
        )
    if kind == "qwen3":
        return Qwen3Config(**{"head_dim": 32, **fields}, tie_word_embeddings=False)
    if kind == "qwen3_yarn":  # YaRN past a 16-token original context (attention factor from factor)
        return Qwen3Config(**{"head_dim": 32, **fields}, tie_word_embeddings=False, rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})
    if kind == "phi3":
        # Phi3Config's default pad id (32000) lies past a tiny vocabulary.
        return Phi3Config(**{"pad_token_id": 0, **fields}, tie_word_embeddings=False)
    raise ValueError(kind)


TINY_WINDOW = 8
"""The tiny windowed models' sliding window: prompts of 20+ tokens run well past it."""


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


# ---- tiny GGUF files, as llama.cpp writes them -------------------------------


def write_gemma_gguf(hf: torch.nn.Module, path: Path, *, q8: bool = False, vocab: list[str] | None = None,
                     chat_template: str | None = None) -> Path:
    """Write ``hf`` (a tiny Gemma 2 / Gemma 3) as llama.cpp's converter does: architecture ``gemma2`` /
    ``gemma3``, its tensor names, every ``*norm.weight`` with Gemma's 1 added, no output tensor (tied),
    the window in ``<arch>.attention.sliding_window`` and the soft-caps as their keys; with ``q8``, every
    projection and the embedding in Q8_0, and ``hf`` given the stored (rounded) values, so that it stays
    the exact reference. Gemma 3's query scale and pattern are llama.cpp's defaults (head_dim, 6) unless
    written: this writes the tiny model's as ``attention.scale`` and ``sliding_window_pattern``. ``vocab``:
    a sentencepiece vocabulary to write as the tokenizer (``<...>`` tokens are control tokens, ``<unk>``
    the unknown one), with ``chat_template``."""
    cfg = hf.config
    arch = "gemma3" if cfg.model_type == "gemma3_text" else "gemma2"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_vocab_size(cfg.vocab_size)  # transformers' reader needs it without a tokenizer
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_attention_scale(cfg.query_pre_attn_scalar**-0.5)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    else:
        full, sliding = cfg.rope_parameters["full_attention"], cfg.rope_parameters["sliding_attention"]
        writer.add_rope_freq_base(full["rope_theta"])
        writer.add_rope_freq_base_swa(sliding["rope_theta"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    from asyncinfer.models.gemma import GEMMA2_WEIGHT_MAP, GEMMA3_WEIGHT_MAP

    if vocab is not None:
        writer.add_tokenizer_model("llama")  # what llama.cpp's converter writes for Gemma's sentencepiece model
        writer.add_token_list(vocab)
        writer.add_token_scores([-float(i) for i in range(len(vocab))])
        writer.add_token_types([2 if t == "<unk>" else 3 if t.startswith("<") and t.endswith(">") else 1
                                for t in vocab])
        writer.add_unk_token_id(vocab.index("<unk>"))
        writer.add_pad_token_id(0)
        writer.add_add_space_prefix(False)
        if chat_template is not None:
            writer.add_chat_template(chat_template)
    names = gguf_names(GEMMA3_WEIGHT_MAP if arch == "gemma3" else GEMMA2_WEIGHT_MAP, cfg.num_hidden_layers)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name == "lm_head.weight":
                continue  # tied: llama.cpp writes no output tensor
            if q8 and p.dim() == 2:
                blocks = gguf.quants.quantize(p.numpy(), gguf.GGMLQuantizationType.Q8_0)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0)))
                writer.add_tensor(names[name], blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            elif name.endswith("norm.weight"):
                writer.add_tensor(names[name], (p + 1).numpy())  # llama.cpp's converter adds Gemma's 1
            else:
                writer.add_tensor(names[name], p.numpy().copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama_header_gguf(path: Path, block_count: int):
    """A ``gguf.GGUFWriter`` at ``path`` holding a tiny Llama's header keys (hidden 64, 4 heads, intermediate 128,
    context 128, vocabulary 32, ``block_count`` layers) and nothing else: tests add the keys and tensors they probe."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    kind = gguf.GGUFValueType
    for key, (value, vtype) in {"embedding_length": (64, kind.UINT32), "attention.head_count": (4, kind.UINT32),
                                "feed_forward_length": (128, kind.UINT32), "context_length": (128, kind.UINT32),
                                "attention.layer_norm_rms_epsilon": (1e-5, kind.FLOAT32),
                                "block_count": (block_count, kind.UINT32), "vocab_size": (32, kind.UINT32)}.items():
        writer.add_key_value(f"llama.{key}", value, vtype)
    return writer


def save_tiny_bert(path: Path, vocab: list[str], *, pooling_layer: bool = False):
    """A random 2-layer BERT (hidden 32, 4 heads, seed 0) and its WordPiece tokenizer over ``vocab`` saved in
    ``path``; returns transformers' model."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64)
    model = BertModel(cfg, add_pooling_layer=pooling_layer).eval()
    model.save_pretrained(path, safe_serialization=True)
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=str(path / "vocab.txt")).save_pretrained(path)
    return model



#: The repository's root (the benchmarks and examples scripts are read from there).
REPO_ROOT = Path(__file__).resolve().parents[1]


def load_script(monkeypatch: Any, path: Path, name: str) -> Any:
    """The module of a script that is not a package's (a benchmark, an example), imported from ``path`` as ``name``
    with its folder on ``sys.path`` for its own imports, both undone by ``monkeypatch`` at the test's end."""
    monkeypatch.syspath_prepend(str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def cli_commands() -> dict[str, argparse.ArgumentParser]:
    """``asyncinfer``'s subcommands' parsers by name."""
    from asyncinfer import cli

    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def cli_refusal(capsys: Any, argv: list[str]) -> str:
    """What ``asyncinfer argv`` says when it refuses them: exit status 2 and one line, no traceback; the line
    without its ``asyncinfer: error:`` prefix."""
    import pytest

    from asyncinfer import cli

    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.removeprefix("asyncinfer: error: ").rstrip("\n")


_GRAMMAR_CHILD = """
import resource, sys
if sys.argv[2] != "0":
    resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[2]), int(sys.argv[2])))
from transformers import AutoTokenizer
from asyncinfer import InvalidParameterError
from asyncinfer.grammar import GrammarCompiler
from asyncinfer.structured import StructuredOutput
compiler = GrammarCompiler(AutoTokenizer.from_pretrained(sys.argv[1]), 320, [2])
try:
    compiler.compile({spec})
    print("compiled")
except InvalidParameterError as exc:
    print("refused", exc.parameter, exc)
"""


def compile_in_child(model: Path, spec: str, *, address_space: int = 0) -> subprocess.CompletedProcess[str]:
    """Compile ``spec`` (a Python expression of a ``StructuredOutput``) with the tokenizer of ``model`` in a child
    interpreter, as the engine compiles it, under an address-space limit of ``address_space`` bytes (0: none): a
    native crash ends the child, not the test. Its stdout is ``compiled`` or ``refused PARAMETER MESSAGE``."""
    return subprocess.run([sys.executable, "-c", _GRAMMAR_CHILD.format(spec=spec), str(model), str(address_space)],
                          check=False, capture_output=True, text=True, timeout=120)

def gguf_names(weight_map, num_layers: int) -> dict[str, str]:
    """HF checkpoint name -> GGUF tensor name, from a family's weight map, for ``num_layers`` layers."""
    names = {}
    for hf_name, gguf_name, _, _ in weight_map:
        for i in range(num_layers) if "{i}" in hf_name else (0,):
            names[hf_name.format(i=i)] = gguf_name.format(i=i)
    return names


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
        dtype = model.norm.weight.dtype  # the model's dtype (an embedding kept in blocks has no float table)
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


def float_bits(t: torch.Tensor) -> torch.Tensor:
    """float32 values as their bits (int32): equal only where each value is the same float, a zero's sign
    included (``torch.equal`` takes -0.0 for 0.0)."""
    return t.contiguous().view(torch.int32)


def loaded_bytes(model: torch.nn.Module) -> int:
    """The bytes the loaded model holds: float parameters plus what the format layers keep (int8 weights and
    scales, float16 weights, oneDNN-packed float32 weights; tests/models/test_quant.py reads them back). A
    MixedBlockLinear's nbytes counts its parts: they are not counted again. An embedding kept in its file's
    blocks (BlockEmbedding) counts the bytes of its blocks, read from the tensor, unless they are a block
    layer's own (a tied head's: counted there)."""
    from asyncinfer.models.quant import BlockEmbedding, BlockLinear, FormatLinear, MixedBlockLinear

    parts = {id(p) for m in model.modules() if isinstance(m, MixedBlockLinear) for p in m.parts}
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(m.nbytes for m in model.modules() if isinstance(m, FormatLinear) and id(m) not in parts)
    held = {m.kernel_weights()[1].data_ptr() for m in model.modules() if isinstance(m, BlockLinear)}
    return total + sum(m.table.blocks.numel() for m in model.modules()
                       if isinstance(m, BlockEmbedding) and m.table.blocks.data_ptr() not in held)


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


class TemplateSpy:
    """Records the thread of every ``apply_chat_template`` call of the tokenizer it wraps."""

    def __init__(self, tokenizer) -> None:
        self.real = tokenizer.apply_chat_template
        self.threads: list[threading.Thread] = []

    def __call__(self, *args, **kwargs):
        self.threads.append(threading.current_thread())
        return self.real(*args, **kwargs)


def gather_tool_deltas(deltas: list[dict[str, Any]]) -> tuple[str, list[dict]]:
    """Chat stream deltas accumulated as an OpenAI client does: content joined, tool calls merged by index
    (a call's first piece carries index, id, type and name with empty arguments; later ones only arguments)."""
    content, calls = "", []
    for delta in deltas:
        content += delta.get("content", "")
        for part in delta.get("tool_calls", []):
            if part["index"] == len(calls):
                assert set(part) == {"index", "id", "type", "function"} and part["function"]["arguments"] == ""
                calls.append({"id": part["id"], "type": part["type"], "function": dict(part["function"])})
            else:
                assert set(part) == {"index", "function"} and set(part["function"]) == {"arguments"}
                calls[part["index"]]["function"]["arguments"] += part["function"]["arguments"]
    return content, calls


class _ComparesAs:
    """Comparisons answered as ``poses_as``, whatever the number holds (for :class:`Posing` / :class:`PosingFloat`)."""

    poses_as: float

    def __lt__(self, other: object) -> bool:
        return self.poses_as < other  # type: ignore[operator,no-any-return]

    def __le__(self, other: object) -> bool:
        return self.poses_as <= other  # type: ignore[operator,no-any-return]

    def __gt__(self, other: object) -> bool:
        return self.poses_as > other  # type: ignore[operator,no-any-return]

    def __ge__(self, other: object) -> bool:
        return self.poses_as >= other  # type: ignore[operator,no-any-return]


class Posing(_ComparesAs, int):
    """An int that compares as another number (``poses_as``), whatever it holds."""

    def __new__(cls, value: int, poses_as: float) -> Self:
        number = super().__new__(cls, value)
        number.poses_as = poses_as
        return number


class PosingFloat(_ComparesAs, float):
    """A float that compares as another number (``poses_as``), whatever it holds."""

    def __new__(cls, value: float, poses_as: float) -> Self:
        number = super().__new__(cls, value)
        number.poses_as = poses_as
        return number


@contextlib.asynccontextmanager
async def loop_lags(period: float) -> AsyncIterator[list[float]]:
    """How long the running loop is held while the block runs: a tick every ``period`` seconds, each late by the time
    the loop was held, collected into the list it yields (read it after the block)."""
    lags: list[float] = []

    async def ticker() -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(period)
            lags.append(time.perf_counter() - start - period)

    tick = asyncio.create_task(ticker())
    try:
        yield lags
    finally:
        tick.cancel()


def with_chat_template(model_dir: Path, target: Path, chat_template: str) -> Path:
    """A copy of the tiny model ``model_dir`` at ``target`` with a small transformers BPE tokenizer (byte level,
    ``<unk>``/``<s>``/``</s>``) whose chat template is ``chat_template``: a model file's template under test."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(model_dir, target)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["Hello world, the quick brown fox."] * 10,
                            trainers.BpeTrainer(vocab_size=280, special_tokens=["<unk>", "<s>", "</s>"],
                                                show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = chat_template
    fast.save_pretrained(target)
    return target


class AllowTokens:
    """A grammar matcher (the sampler's ``fill``) that allows a fixed set of tokens at every position."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        bits = np.zeros(bitmask.shape[1] * 32, dtype=np.bool_)
        bits[self.tokens] = True
        bitmask[row] = torch.from_numpy(np.packbits(bits, bitorder="little").view(np.int32).copy())


class EngineOnLoop:
    """One engine on an event loop of its own thread, for tests (Hypothesis's included) that submit to it from
    theirs."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.call(engine.start())

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 600) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def generate_all(self, jobs: list[tuple[Any, SamplingParams]]) -> list[Any]:
        async def run() -> list[Any]:
            return list(await asyncio.gather(*(self.engine.generate(p, sp) for p, sp in jobs)))
        return self.call(run())

    def close(self) -> None:
        self.call(self.engine.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


def warpers_kept(row: torch.Tensor, params: SamplingParams) -> set[int]:
    """The columns of one row of logits that transformers' TopK / TopP / MinP warpers keep for ``params`` (the
    sampler's filters' reference)."""
    from transformers import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = row[None].clone()
    ids = torch.zeros(1, 1, dtype=torch.long)
    if params.top_k > 0:
        scores = TopKLogitsWarper(top_k=params.top_k)(ids, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(top_p=params.top_p)(ids, scores)
    if params.min_p > 0.0:
        scores = MinPLogitsWarper(min_p=params.min_p)(ids, scores)
    return set(torch.nonzero(torch.isfinite(scores[0])).flatten().tolist())


class CharTokenizer:
    """Each token id decodes to a character of its own (``chr(0x4E00 + id)``): for a tiny model, which has no
    tokenizer, given as ``engine.core.tokenizer`` so that stop strings and text run."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(0x4E00 + i) for i in ids)


def long_stops(variant: int) -> list[str]:
    """A stop list at both limits (``MAX_STOP_STRINGS`` strings, ``MAX_STOP_CHARS`` characters), of its own for each
    ``variant`` (each needs its own automaton)."""
    length = MAX_STOP_CHARS // MAX_STOP_STRINGS
    return [chr(0xE000 + variant) + f"{i:0{length - 1}d}" for i in range(MAX_STOP_STRINGS)]



def hold_swap_loads(monkeypatch: Any, timeout: float = 60.0) -> threading.Event:
    """Hold every swap's (or add's) model load (``swaps.load``) until the returned event is set (each load asserts it
    is set within ``timeout`` seconds): a drain-mode swap held between its versions, none serving."""
    from asyncinfer import swaps

    release = threading.Event()
    real_load = swaps.load

    def held_load(*args: Any, **kwargs: Any) -> Any:
        assert release.wait(timeout)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(swaps, "load", held_load)
    return release


def slow_stop_turns_engine(path: Any, monkeypatch: Any) -> Any:
    """An engine over the tiny model at ``path`` with four places (``max_num_seqs`` 2 + ``max_waiting_requests`` 2),
    whose stop-list line admits a list at the limits every 4 s (``intake.STOP_BUILD_CHARS_PER_S`` at 4096, set with
    ``monkeypatch`` before it is made), given a :class:`CharTokenizer`: for the tests of requests waiting their turn."""
    import asyncinfer.intake
    from asyncinfer import AsyncEngine

    monkeypatch.setattr(asyncinfer.intake, "STOP_BUILD_CHARS_PER_S", 4096)
    engine = AsyncEngine.from_pretrained(path, **{**ENGINE_BASE, "max_num_seqs": 2, "max_waiting_requests": 2})
    engine.core.tokenizer = CharTokenizer()
    return engine


async def fill_stop_turns(engine: Any, stops: Any) -> None:
    """Take the stop-list bucket's two turns (``intake.Turns``: two lists at the limit, ``stops(0)`` and
    ``stops(1)``), so that the next long list waits its turn."""
    for i in range(2):
        await engine.generate([5, 6, 7], SamplingParams(max_tokens=1, stop=stops(i)))


def send_victim(engine: Any, params: SamplingParams, how: str) -> asyncio.Future:
    """Request ``"victim"`` of ``params``, sent by ``how``: ``"generate"``, the future of its result; ``"stream"``,
    of its deltas, read to the end."""
    if how == "generate":
        return asyncio.ensure_future(engine.generate([5, 6, 7], params, request_id="victim"))

    async def read() -> list:
        return [d async for d in engine.stream([5, 6, 7], params, request_id="victim")]
    return asyncio.ensure_future(read())


def interrupt(proc: subprocess.Popen) -> str:
    """Ctrl-C (SIGINT) to a server started with its output piped, and what it printed once it exited (killed
    past 60 s)."""
    proc.send_signal(signal.SIGINT)
    try:
        output, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return output


@contextlib.contextmanager
def sigint_not_ignored() -> Iterator[None]:
    """Children started in the block get SIGINT's default disposition, unblocked (exec resets a handler, but keeps
    SIG_IGN and the signal mask), whatever this process had: Python's handler meanwhile where it was ignored. A
    suite started in the background of a shell without job control (``cmd &``, ``(nohup cmd &)``: the ``&`` ignores
    SIGINT) otherwise hands its children an ignored SIGINT, and the Ctrl-C a test sends one is lost."""
    before = signal.getsignal(signal.SIGINT)
    blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    if before is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if blocked:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    try:
        yield
    finally:
        if blocked:
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
        if before is signal.SIG_IGN:
            signal.signal(signal.SIGINT, before)
