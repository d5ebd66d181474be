"""Qwen3 and Phi-3 (issue 23, item 3): from Hugging Face directories and from GGUF, token for token
against transformers, on the torch reference decode and on the decode backend the engine selects, each
with its chat template; Phi-3's longrope rope scaling past its original context (prefill, and greedy tokens against
transformers' ``generate()``, which computes a sequence again when it grows past that context), bad longrope
parameters refused by name; unsupported rope types and architectures refused before any weight is read.

The tiny random models come from the families' own config classes (``tests.helpers.tiny_hf_model``:
Qwen3 with q/k norms and an explicit head_dim wider than hidden / heads, Phi-3 with fused qkv and
gate_up). Their projections, embedding and head are rounded once to Q8_0 blocks, so that the same
numbers are the model's float32 weights, a GGUF file's Q8_0 tensors and the block format's weights:
transformers on those weights is the reference for every path. The GGUF files are written with the
``gguf`` package's writer, under the tensor names its constants give each architecture.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import MODEL_ARCH_NAMES, MODEL_TENSOR, MODEL_TENSORS, TENSOR_NAMES
from transformers import AutoTokenizer, Phi3Config, PreTrainedTokenizerFast, Qwen3Config

from asyncinfer import AsyncEngine, InvalidParameterError, SamplingParams, kernels
from asyncinfer.errors import ModelLoadError
from asyncinfer.models import ModelConfig, load_model, model_family
from asyncinfer.models.attention.sdpa import KernelDecodeSdpaBackend, SdpaBackend
from asyncinfer.models.decode_backends import (
    KernelDecode,
    TorchDecode,
    kernel_decode_blocker,
    select_decode_backend,
)
from asyncinfer.models.gguf_file import GGUFFile
from asyncinfer.models.layers import RopeRows, rope_attention_factor
from asyncinfer.models.phi3 import PHI3_WEIGHT_MAP
from asyncinfer.models.quant import BlockEmbedding, BlockLinear, apply_weight_format
from asyncinfer.models.qwen3 import Qwen3Attention, Qwen3ForCausalLM
from asyncinfer.models.registry import supported_architectures
from tests.helpers import PagedRunner, greedy, hf_greedy, hf_logits, random_prompts, tiny_hf_model

FAMILIES = ("qwen3", "phi3")
Q8_0 = gguf.GGMLQuantizationType.Q8_0
OPTIONS = {"kv_cache_memory": 4 * 1024 * 1024, "max_model_len": 256, "device": "cpu"}
NEW_TOKENS = 16

# ---- chat templates in each family's style (written for these tests) ------------------------------

# Qwen3's shape: ChatML turns, a system turn only first, the reasoning before "</think>" dropped from
# earlier assistant turns, and an empty thinking block when the caller turns thinking off.
QWEN3_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(turns=0) %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{%- set ns.turns = ns.turns + 1 %}"
    "{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}{%- set content = m.content %}"
    "{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'system' and not loop.first %}{{- raise_exception('a system message comes first') }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
# Phi-3's shape: "<|role|>" turns closed by "<|end|>", any other role refused.
PHI3_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] in ['system', 'user', 'assistant'] %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% else %}{{ raise_exception('Phi-3 roles are system, user and assistant') }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)
TEMPLATES = {"qwen3": QWEN3_TEMPLATE, "phi3": PHI3_TEMPLATE}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "<think>\nFrance.\n</think>\n\nParis."},
            {"role": "user", "content": "And of Italy?"}]
RENDERED = {
    "qwen3": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
             "<|im_start|>assistant\nParis.<|im_end|>\n<|im_start|>user\nAnd of Italy?<|im_end|>\n"
             "<|im_start|>assistant\n",
    "phi3": "<|system|>\nBe brief.<|end|>\n<|user|>\nWhat is the capital of France?<|end|>\n"
            "<|assistant|>\n<think>\nFrance.\n</think>\n\nParis.<|end|>\n<|user|>\nAnd of Italy?<|end|>\n"
            "<|assistant|>\n",
}
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|system|>", "<|user|>", "<|assistant|>",
            "<|end|>"]
THINK = ["<think>", "</think>"]  # plain added tokens (llama.cpp's USER_DEFINED), kept whole
CORPUS = ["What is the capital of France? Paris is. And of Italy? Rome.", "Be brief. system user assistant",
          "The quick brown fox jumps over the lazy dog, 1 2 3 4 5."] * 10


def byte_level_tokenizer(template: str) -> PreTrainedTokenizerFast:
    """A byte-level BPE (Qwen's kind of vocabulary) trained in memory: ids below the tiny models' 320."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=290, special_tokens=SPECIALS, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.add_tokens(THINK)
    fast.chat_template = template
    assert fast.eos_token_id == 2 and len(fast) <= 320
    return fast


# ---- tiny models and their files ------------------------------------------------------------------


def round_to_q8_0(hf: torch.nn.Module) -> dict[str, np.ndarray]:
    """Round every matrix of ``hf`` (projections, embedding, head) to Q8_0 in place; return the blocks."""
    blocks = {}
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.ndim == 2:
                q = gguf.quants.quantize(p.numpy(), Q8_0)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(q, Q8_0)))
                blocks[name] = q
    return blocks


# Hugging Face parameter names -> llama.cpp's tensor kinds (gguf.constants); "{bid}" is the layer.
_GGUF_KINDS = [
    (r"model\.embed_tokens\.weight", MODEL_TENSOR.TOKEN_EMBD),
    (r"model\.norm\.weight", MODEL_TENSOR.OUTPUT_NORM),
    (r"lm_head\.weight", MODEL_TENSOR.OUTPUT),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", MODEL_TENSOR.ATTN_NORM),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", MODEL_TENSOR.FFN_NORM),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight", MODEL_TENSOR.ATTN_Q),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.weight", MODEL_TENSOR.ATTN_K),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.weight", MODEL_TENSOR.ATTN_V),
    (r"model\.layers\.(\d+)\.self_attn\.qkv_proj\.weight", MODEL_TENSOR.ATTN_QKV),
    (r"model\.layers\.(\d+)\.self_attn\.q_norm\.weight", MODEL_TENSOR.ATTN_Q_NORM),
    (r"model\.layers\.(\d+)\.self_attn\.k_norm\.weight", MODEL_TENSOR.ATTN_K_NORM),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", MODEL_TENSOR.ATTN_OUT),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight", MODEL_TENSOR.FFN_GATE),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.weight", MODEL_TENSOR.FFN_UP),
    (r"model\.layers\.(\d+)\.mlp\.gate_up_proj\.weight", MODEL_TENSOR.FFN_UP),  # llama.cpp's phi3: gate and up
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", MODEL_TENSOR.FFN_DOWN),
]
_ARCHS = {name: arch for arch, name in MODEL_ARCH_NAMES.items()}


def gguf_tensor_name(arch: str, hf_name: str) -> str:
    """The tensor's name in a llama.cpp GGUF of ``arch``, from gguf.constants (a kind that architecture declares)."""
    for pattern, kind in _GGUF_KINDS:
        match = re.fullmatch(pattern, hf_name)
        if match:
            assert kind in MODEL_TENSORS[_ARCHS[arch]], f"{arch} has no {kind.name} ({hf_name})"
            return TENSOR_NAMES[kind].format(bid=match.group(1) if match.groups() else "") + ".weight"
    raise KeyError(hf_name)


def write_gguf(path: Path, arch: str, hf: torch.nn.Module, blocks: dict[str, np.ndarray],
               tokenizer: PreTrainedTokenizerFast | None = None, *, extra: dict[str, np.ndarray] | None = None) -> Path:
    """``hf`` as llama.cpp lays out a GGUF of ``arch``: Q8_0 matrices (``blocks``), F32 norms, the
    config as metadata, and with ``tokenizer`` its vocabulary, merges and chat template."""
    cfg = hf.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    if tokenizer is not None:
        vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
        assert [i for _, i in vocab] == list(range(len(vocab)))
        model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_list([t for t, _ in vocab])
        writer.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.USER_DEFINED
                                if t in THINK else gguf.TokenType.NORMAL for t, _ in vocab])
        writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
        writer.add_add_bos_token(False)
        writer.add_chat_template(tokenizer.chat_template)
    for name, p in hf.named_parameters():
        if name in blocks:
            writer.add_tensor(gguf_tensor_name(arch, name), blocks[name], raw_dtype=Q8_0)
        else:
            writer.add_tensor(gguf_tensor_name(arch, name), p.detach().numpy().copy())
    for name, data in {**_longrope_tensors(writer, cfg), **(extra or {})}.items():
        if data is not None:  # extra: None drops a tensor
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _longrope_tensors(writer: gguf.GGUFWriter, cfg: Any) -> dict[str, np.ndarray]:
    """A longrope config's factor tensors, and its metadata written as llama.cpp's converter writes them: the
    original context, and the attention factor from the ratio of the contexts; {} for any other rope."""
    rope = cfg.rope_parameters
    if rope.get("rope_type") != "longrope":
        return {}
    original = rope["original_max_position_embeddings"]
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(cfg.max_position_embeddings / original)
                                                   / math.log(original)))
    return {"rope_factors_long.weight": np.array(rope["long_factor"], np.float32),
            "rope_factors_short.weight": np.array(rope["short_factor"], np.float32)}


class Family:
    """One family's tiny model (weights rounded to Q8_0), saved as a Hugging Face directory (with a
    tokenizer and the family's chat template) and as a GGUF file (the same weights, vocabulary and template).
    ``overrides``: fields of the family's config (``tests.helpers.tiny_hf_config``)."""

    def __init__(self, kind: str, root: Path, **overrides: Any) -> None:
        self.kind = kind
        self.hf = tiny_hf_model(kind, seed=3, **{"vocab_size": 320, "max_position_embeddings": 512, **overrides})
        self.hf.generation_config.eos_token_id = None  # hf_greedy's references run to their length
        self.hf.generation_config.pad_token_id = 0
        self.blocks = round_to_q8_0(self.hf)
        self.tokenizer = byte_level_tokenizer(TEMPLATES[kind])
        self.hf_dir = root / "hf"
        self.hf.save_pretrained(self.hf_dir, safe_serialization=True)
        self.tokenizer.save_pretrained(self.hf_dir)
        self.gguf = write_gguf(root / f"tiny-{kind}.gguf", kind, self.hf, self.blocks, self.tokenizer)

    def path(self, source: str) -> Path:
        return self.hf_dir if source == "hf" else self.gguf


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Family]:
    return {kind: Family(kind, tmp_path_factory.mktemp(f"family-{kind}")) for kind in FAMILIES}


@pytest.fixture(autouse=True)
def _tokenizer_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF file's tokenizer is cached under the test's own directory, never the user's cache."""
    monkeypatch.setenv("ASYNCINFER_CACHE_DIR", str(tmp_path / "cache"))


# ---- the families, registered ------------------------------------------------------------------


def test_the_families_are_registered_for_hf_and_gguf() -> None:
    assert {"qwen3", "phi3"} <= set(supported_architectures(gguf=True))
    assert model_family("Qwen3ForCausalLM").name == "qwen3" and model_family("qwen3").model_class is Qwen3ForCausalLM
    phi3 = model_family("Phi3ForCausalLM")
    assert phi3.name == "phi3" and phi3.weight_map is PHI3_WEIGHT_MAP and phi3.sliding_window
    assert not model_family("qwen3").qkv_bias and not model_family("qwen3").gguf_permuted_qk
    assert not phi3.qkv_bias and not phi3.gguf_permuted_qk


@pytest.mark.parametrize("kind", FAMILIES)
def test_the_config_reads_the_same_from_both_sources(families, kind) -> None:
    family = families[kind]
    hf_config = load_model(family.hf_dir, torch.float32, "cpu").config
    gguf_config = load_model(family.gguf, torch.float32, "cpu").config
    assert hf_config.architecture == gguf_config.architecture == kind
    assert hf_config.head_dim == gguf_config.head_dim == (32 if kind == "qwen3" else 16)
    assert hf_config.q_size == gguf_config.q_size == (128 if kind == "qwen3" else 64)  # qwen3: wider than hidden
    assert not hf_config.attention_bias and not hf_config.tie_word_embeddings
    assert gguf_config.native_format == "q8_0"  # every projection and the head in Q8_0, attn_qkv included
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "rope_theta", "rope_scaling", "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(hf_config, field) == getattr(gguf_config, field), field
    assert gguf_config.rms_norm_eps == pytest.approx(hf_config.rms_norm_eps, rel=1e-6)  # GGUF stores a float32


@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_prefill_logits_match_transformers(families, kind, source) -> None:
    """Every position's logits over a shuffled paged cache, in two chunks, against transformers' forward."""
    family = families[kind]
    loaded = load_model(family.path(source), torch.float32, "cpu")
    assert type(loaded.model) is (Qwen3ForCausalLM if kind == "qwen3" else model_family("phi3").model_class)
    tokens = random_prompts(1, seed=11, max_len=60, vocab=320)[0]
    expected = hf_logits(family.hf, tokens)
    runner = PagedRunner(loaded.model, block_size=4, seed=2)
    cut = len(tokens) // 2
    (first,) = runner.step([(0, tokens[:cut])])
    (second,) = runner.step([(0, tokens[cut:])])
    torch.testing.assert_close(torch.cat([first, second]), expected, atol=1e-4, rtol=0)


# ---- through the engine: the torch reference decode and the selected backend ----------------------


async def engine_greedy(path: Path, prompts: list[list[int]], **options: Any) -> tuple[list[list[int]], Any]:
    """Greedy tokens of ``prompts`` (submitted together) from ``AsyncEngine.from_pretrained``, and the runner."""
    engine = AsyncEngine.from_pretrained(path, **OPTIONS, **options)
    async with engine:
        outs = await asyncio.gather(*(engine.generate(p, greedy(NEW_TOKENS)) for p in prompts))
        assert max(engine.step_stats().batch_sizes) > 1  # the prompts shared decode steps
        runner = engine.core.runner
    return [out.token_ids for out in outs], runner


# float32 on the torch reference; the block format (q8_0: the file's own under "auto" for a GGUF) on
# whatever decode backend the engine selects for the family.
FORMATS = {"float32": {"dtype": "float32"}, "q8_0": {"quantization": "q8_0"}}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("kind", FAMILIES)
async def test_greedy_tokens_equal_transformers(families, kind, source, fmt) -> None:
    family = families[kind]
    options = {"quantization": "auto"} if (source, fmt) == ("gguf", "q8_0") else FORMATS[fmt]
    prompts = random_prompts(4, seed=7, vocab=320)
    tokens, runner = await engine_greedy(family.path(source), prompts, **options)
    for prompt, got in zip(prompts, tokens):
        assert got == hf_greedy(family.hf, prompt, NEW_TOKENS)
    blocker = kernel_decode_blocker(runner.model)
    if fmt == "float32":
        assert type(runner.decode) is TorchDecode
        assert not any(isinstance(m, BlockLinear) for m in runner.model.modules())
        return
    assert kernels.available(), kernels.unavailable_reason()
    layers = [m for m in runner.model.modules() if isinstance(m, BlockLinear)]
    assert len(layers) == 4 * 2 + 1 and all(m.fmt == "q8_0" and m.lossless for m in layers)  # the same weights
    # From the file, the (untied) embedding stays in its Q8_0 blocks; from Hugging Face, a float table.
    embedding = runner.model.embed_tokens
    assert type(embedding) is (BlockEmbedding if source == "gguf" else torch.nn.Embedding)
    assert source == "hf" or (embedding.fmt == "q8_0" and not embedding.shared)
    # Phi-3: Llama's layer exactly; Qwen3: with its per-head q/k norms, which the kernels' layer applies.
    assert blocker is None and type(runner.decode) is KernelDecode


@pytest.mark.parametrize("kind", FAMILIES)
def test_each_family_gets_its_decode_backend_in_q4_1(families, kind) -> None:
    """In a block format both decode in one kernel call a step (KernelDecode), the attention in the kernel;
    its decode steps give the torch reference's logits (float32 rounding) and the same greedy tokens, so
    Qwen3's q/k norms are applied in the kernels' layer as the reference applies them."""
    assert kernels.available(), kernels.unavailable_reason()
    model = load_model(families[kind].hf_dir, torch.float32, "cpu").model
    apply_weight_format(model, "q4_1")
    chosen = select_decode_backend(model, model.config, "cpu")
    assert type(chosen.attention) is KernelDecodeSdpaBackend
    assert type(chosen) is KernelDecode and kernel_decode_blocker(model) is None
    if kind == "qwen3":
        assert all(type(layer.attn) is Qwen3Attention for layer in model.layers)
        assert chosen.stack.layers[0]._args["q_norm"] is not None
    cpu = torch.device("cpu")
    reference = TorchDecode(model, SdpaBackend(), cpu)
    fused, plain = PagedRunner(model, seed=1), PagedRunner(model, seed=1)
    prompts = random_prompts(3, seed=3, vocab=320)
    work = list(zip(range(3), prompts))
    first = chosen.forward(fused.step_batch(work, last_only=True), fused.kv_caches)
    reference.forward(plain.step_batch(work, last_only=True), plain.kv_caches)
    last = first.logits.argmax(dim=-1).tolist()
    for _ in range(4):
        work = [(s, [t]) for s, t in zip(range(3), last)]
        a = chosen.forward(fused.step_batch(work), fused.kv_caches)
        b = reference.forward(plain.step_batch(work), plain.kv_caches)
        assert a.greedy_ids is not None and b.greedy_ids is None  # the step ran in the kernel
        torch.testing.assert_close(a.logits, b.logits, atol=1e-3, rtol=1e-3)
        assert a.greedy_ids == b.logits.argmax(dim=-1).tolist()
        last = a.greedy_ids


# ---- chat templates ------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("kind", FAMILIES)
async def test_chat_messages_go_through_the_familys_template(families, kind, source) -> None:
    """The template comes with the model (tokenizer_config.json, or the GGUF's tokenizer.chat_template):
    the engine renders messages as transformers renders them with the same tokenizer, and greedy tokens
    from those messages equal transformers' from the rendered ids."""
    family = families[kind]
    path = family.path(source)
    reference = (AutoTokenizer.from_pretrained(family.hf_dir) if source == "hf"
                 else AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name))
    assert reference.chat_template == TEMPLATES[kind]
    text = reference.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text == RENDERED[kind]
    want = reference.encode(text, add_special_tokens=False)
    engine = AsyncEngine.from_pretrained(path, **OPTIONS, dtype="float32")
    async with engine:
        ids = engine.apply_chat_template(MESSAGES)
        assert ids == want and engine.count_tokens(MESSAGES) == len(want)
        # The family's markers stay single special tokens.
        marker = "<|im_start|>" if kind == "qwen3" else "<|assistant|>"
        assert ids.count(reference.convert_tokens_to_ids(marker)) == (5 if kind == "qwen3" else 2)
        out = await engine.generate(MESSAGES, greedy(NEW_TOKENS))
        assert out.prompt_token_ids == want
        assert out.token_ids == hf_greedy(family.hf, want, NEW_TOKENS)
        with pytest.raises(InvalidParameterError, match="chat template"):
            bad = ([{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}] if kind == "qwen3"
                   else [{"role": "tool", "content": "42"}])
            engine.apply_chat_template(bad)


# ---- refused: rope types, architectures, before any weight is read -------------------------------


def _garbage_weights(path: Path) -> None:
    """A model.safetensors that no reader can parse: reading it would fail with 'cannot read weights'."""
    (path / "model.safetensors").write_bytes(b"\xff" * 64)


_SMALL = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
          "num_attention_heads": 4, "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": 2}
ROPE_CONFIGS = {
    "qwen3 dynamic": (lambda: Qwen3Config(**_SMALL, rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "dynamic"),
}


@pytest.mark.parametrize("case", ROPE_CONFIGS)
def test_a_rope_type_not_implemented_is_refused_by_name(tmp_path, case) -> None:
    make, rope_type = ROPE_CONFIGS[case]
    config = make()
    with pytest.raises(ModelLoadError, match=f"unsupported rope type '{rope_type}'; supported: default, linear"):
        ModelConfig.from_hf_config(config)
    config.save_pretrained(tmp_path)
    _garbage_weights(tmp_path)
    with pytest.raises(ModelLoadError, match=f"unsupported rope type '{rope_type}'"):
        AsyncEngine.from_pretrained(tmp_path, **OPTIONS)


SUPPORTED = ", ".join(supported_architectures())


@pytest.fixture
def no_weight_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any read of a GGUF tensor's bytes fails the test."""
    def refuse(*_: Any) -> None:
        raise AssertionError("a weight was read")

    monkeypatch.setattr(GGUFFile, "raw", refuse)
    monkeypatch.setattr(GGUFFile, "dequantize", refuse)


@pytest.mark.parametrize(("model_type", "architectures"), [
    ("gpt_neox", ["GPTNeoXForCausalLM"]),  # transformers knows it; no family here runs it
    ("brand_new_arch", ["BrandNewForCausalLM"]),  # transformers does not know it either
    ("qwen3_moe", None),
])
def test_an_unsupported_hf_architecture_is_refused_before_any_weight(tmp_path, model_type, architectures) -> None:
    config = {"model_type": model_type, "vocab_size": 64, "hidden_size": 64, "num_hidden_layers": 1}
    if architectures:
        config["architectures"] = architectures
    (tmp_path / "config.json").write_text(json.dumps(config))
    _garbage_weights(tmp_path)
    named = f" \\(architectures: {architectures[0]}\\)" if architectures else ""
    message = f"unsupported model_type '{model_type}'{named}; supported: {re.escape(SUPPORTED)}$"
    with pytest.raises(ModelLoadError, match=f"^{message}"):
        load_model(tmp_path, torch.float32, "cpu")
    with pytest.raises(ModelLoadError, match=f"^loading '{re.escape(str(tmp_path))}' failed: {message}"):
        AsyncEngine.from_pretrained(tmp_path, **OPTIONS)


@pytest.mark.parametrize("arch", ["gpt2", "qwen3moe", "phimoe"])
def test_an_unsupported_gguf_architecture_is_refused_before_any_weight(families, tmp_path, no_weight_reads,
                                                                       arch) -> None:
    """A GGUF whose tensors are all there (a real model's, under llama.cpp's names) but whose architecture
    no family runs: refused from the header, the weights never touched."""
    family = families["qwen3"]
    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(family.hf.config.num_hidden_layers)
    for name, p in family.hf.named_parameters():
        writer.add_tensor(gguf_tensor_name("qwen3", name), p.detach().numpy().copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    supported = ", ".join(supported_architectures(gguf=True))
    message = f"unsupported GGUF architecture '{arch}'; supported: {re.escape(supported)}$"
    with pytest.raises(ModelLoadError, match=f"^{message}"):
        load_model(path, torch.float32, "cpu")
    with pytest.raises(ModelLoadError, match=f"^loading '{re.escape(str(path))}' failed: {message}"):
        AsyncEngine.from_pretrained(path, **OPTIONS)


# ---- Phi-3's longrope ("su") rope scaling -----------------------------------------------------------------

ORIGINAL = 32
"""The tiny longrope model's original context (its context is 128): prompts and replies run past it."""
LONGROPE = {  # one factor a frequency (head_dim 16: 8 each); the long ones stretch the slow frequencies most
    "rope_type": "longrope", "original_max_position_embeddings": ORIGINAL,
    "short_factor": [1.0, 1.02, 1.05, 1.1, 1.2, 1.35, 1.5, 1.7],
    "long_factor": [1.0, 1.2, 1.6, 2.2, 3.0, 4.5, 6.0, 8.0],
}
LONGROPE_OPTIONS = {**OPTIONS, "max_model_len": 128, "max_num_batched_tokens": 16}  # prefills in 16-token chunks


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 320) for _ in range(n)]


@pytest.fixture(scope="module")
def longrope(tmp_path_factory: pytest.TempPathFactory) -> Family:
    """A tiny Phi-3 with longrope scaling (its config class's own), as a Hugging Face directory and a GGUF file."""
    return Family("phi3", tmp_path_factory.mktemp("family-longrope"), max_position_embeddings=128,
                  original_max_position_embeddings=ORIGINAL, rope_scaling=dict(LONGROPE))


def test_longrope_reads_the_same_from_both_sources(longrope) -> None:
    """The factors, the original context and the attention factor (transformers' sqrt(1 + log(128 / 32) / log(32))
    from the Hugging Face config; llama.cpp's converter writes that value in the GGUF); "su", Phi-3's first
    spelling, reads as longrope."""
    configs = [load_model(longrope.path(source), torch.float32, "cpu") for source in ("hf", "gguf")]
    for loaded in configs:
        scaling = loaded.config.rope_scaling
        assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == ORIGINAL
        for key in ("short_factor", "long_factor"):
            assert scaling[key] == pytest.approx(LONGROPE[key], rel=1e-7)  # the GGUF's are float32
        assert rope_attention_factor(loaded.config) == pytest.approx(math.sqrt(1 + math.log(4) / math.log(32)), rel=1e-6)
        assert RopeRows.of(loaded.config) == RopeRows(128, ORIGINAL)
        assert loaded.model.rotary.cos_cache.shape == (128 + ORIGINAL, 8)  # short/long rows, then long below 32
    assert "attention_factor" not in configs[0].config.rope_scaling  # from the contexts, as transformers does
    su = Phi3Config(**_SMALL, pad_token_id=0, original_max_position_embeddings=64,
                    rope_scaling={"type": "su", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8,
                                  "original_max_position_embeddings": 64})
    scaling = ModelConfig.from_hf_config(su).rope_scaling
    assert scaling == {"rope_type": "longrope", "short_factor": (1.0,) * 8, "long_factor": (4.0,) * 8,
                       "original_max_position_embeddings": 64}


def test_longrope_rows_depend_on_the_requests_length_only() -> None:
    """Up to 32 tokens, a request reads the short rows (its positions); longer, the long ones: rows 128 + p below
    32, in any chunks; a decode (position p of a request of p + 1 tokens) reads its position; the switch is at 33."""
    rows = RopeRows(128, ORIGINAL)
    short, long = [], []
    rows.extend(short, ORIGINAL, 0, ORIGINAL)
    for start, end in ((0, 20), (20, 45)):
        rows.extend(long, 45, start, end)
    assert short == list(range(ORIGINAL)) and long == [128 + p for p in range(ORIGINAL)] + list(range(ORIGINAL, 45))
    decodes: list[int] = []
    for p in (5, ORIGINAL - 1, ORIGINAL, 100):
        rows.extend(decodes, p + 1, p, p + 1)
    assert decodes == [5, ORIGINAL - 1, ORIGINAL, 100]
    assert [rows.long(n) for n in (1, ORIGINAL, ORIGINAL + 1)] == [False, False, True]
    assert [rows.switches(n) for n in (ORIGINAL, ORIGINAL + 1, ORIGINAL + 2)] == [False, True, False]
    plain = RopeRows(128)  # any other rope, or an original context not shorter than the model's
    assert plain.num_rows == 128 and not plain.long(100) and not plain.switches(1)


@pytest.mark.parametrize("length", [ORIGINAL, ORIGINAL + 13])
@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_longrope_prefill_logits_match_transformers(longrope, source, length) -> None:
    """Every position's logits of a prompt prefilled in two chunks (20 tokens, then the rest: across the original
    context for the longer one), against transformers' one forward over it: the short factors for a prompt of
    up to 32 tokens, the long ones on every token of a longer one (the first chunk included: its rows are the
    request's, not the chunk's). Read with plain positions (short below 32), the longer prompt's logits are not
    transformers'."""
    loaded = load_model(longrope.path(source), torch.float32, "cpu")
    tokens = _tokens(length, seed=length)
    expected = hf_logits(longrope.hf, tokens)
    rows = RopeRows.of(loaded.config)
    decode = TorchDecode(loaded.model, SdpaBackend(), torch.device("cpu"))

    def prefill(rows_of: Any) -> torch.Tensor:
        runner = PagedRunner(loaded.model, block_size=4, seed=2)
        logits = []
        for start, end in ((0, 20), (20, length)):
            step = runner.step_batch([(0, tokens[start:end])])
            step.positions = []
            rows_of(step.positions, start, end)
            logits.append(decode.forward(step, runner.kv_caches).logits)
        return torch.cat(logits)

    torch.testing.assert_close(prefill(lambda out, a, b: rows.extend(out, length, a, b)), expected, atol=1e-4, rtol=0)
    if length > ORIGINAL:
        plain = prefill(lambda out, a, b: out.extend(range(a, b)))
        assert (plain[:ORIGINAL] - expected[:ORIGINAL]).abs().max() > 1e-2


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("source", ["hf", "gguf"])
async def test_longrope_greedy_tokens_equal_transformers(longrope, source, fmt) -> None:
    """Greedy tokens equal transformers' ``generate()`` for prompts that end below, at and past the original context,
    each generating past it, submitted together and in 16-token prefill chunks: the prompts of up to 32 tokens run
    on the short factors until they grow past 32 tokens, are then computed again on the long ones (as
    transformers' Phi-3 ``generate()`` does; counted as one preemption each) and decode on; the 45-token one runs
    on the long factors throughout. The prompts share a prefix with one computed before on the short factors: a
    longer request never reuses those blocks. In q8_0, decode steps run in the kernels' one-call step."""
    options = {"quantization": "auto"} if (source, fmt) == ("gguf", "q8_0") else FORMATS[fmt]
    base = _tokens(ORIGINAL + 13, seed=13)
    prompts = [base[:20], base, base[:ORIGINAL - 1], base[:ORIGINAL]]
    expected = [hf_greedy(longrope.hf, prompt, 24) for prompt in prompts]
    engine = AsyncEngine.from_pretrained(longrope.path(source), **LONGROPE_OPTIONS, **options)
    async with engine:
        alone = await engine.generate(prompts[0], greedy(24))  # its prompt's full block cached, short factors
        outs = await asyncio.gather(*(engine.generate(p, greedy(24)) for p in prompts))
        assert max(engine.step_stats().batch_sizes) > 1
        runner = engine.core.runner
    assert alone.token_ids == expected[0] and alone.metrics.num_preemptions == 1
    assert [out.token_ids for out in outs] == expected
    assert [out.metrics.num_preemptions for out in outs] == [1, 0, 1, 1]  # computed again once, at 33 tokens
    if fmt == "q8_0":
        assert type(runner.decode) is KernelDecode and kernel_decode_blocker(runner.model) is None


async def test_longrope_samples_of_a_request_each_switch_once(longrope) -> None:
    """``n = 3`` greedy samples forked from prompts of 32 tokens (forked at the switch itself) and of 20: each sample
    is computed again on its own when it grows past the original context, and each equals ``generate()``'s tokens."""
    base = _tokens(ORIGINAL, seed=17)
    prompts = [base, base[:20]]
    expected = [hf_greedy(longrope.hf, prompt, 24) for prompt in prompts]
    engine = AsyncEngine.from_pretrained(longrope.hf_dir, **LONGROPE_OPTIONS, dtype="float32")
    async with engine:
        outs = await asyncio.gather(*(engine.generate(p, SamplingParams(max_tokens=24, n=3, temperature=0))
                                      for p in prompts))
    for out, want in zip(outs, expected):
        assert [sample.token_ids for sample in out.outputs] == [want] * 3
        assert out.metrics.num_preemptions == 3  # one a sample


def _longrope_dir(longrope: Family, tmp_path: Path, **rope: Any) -> Path:
    """The tiny longrope model's config.json with ``rope`` in its rope parameters (and the original context beside
    them, which transformers reads first), and weights no reader can parse."""
    config = json.loads((longrope.hf_dir / "config.json").read_text())
    config["rope_parameters"].update(rope)
    config["original_max_position_embeddings"] = config["rope_parameters"]["original_max_position_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    _garbage_weights(tmp_path)
    return tmp_path


@pytest.mark.parametrize(("rope", "message"), [
    ({"short_factor": [1.0] * 3}, r"short_factor field must have length 8, got 3"),  # transformers' own check
    ({"long_factor": [1.0, 2.0, 3.0, 0.0, 5.0, 6.0, 7.0, 8.0]},
     r"longrope rope: long_factor\[3\] must be a finite number > 0, got 0\.0"),
    ({"short_factor": [-1.0] * 8}, r"longrope rope: short_factor\[0\] must be a finite number > 0, got -1\.0"),
    ({"attention_factor": -0.5}, r"longrope rope: attention_factor must be a finite number > 0, got -0\.5"),
    ({"original_max_position_embeddings": 1}, r"original_max_position_embeddings must be an int >= 2, got 1"),
])
def test_bad_longrope_parameters_are_refused_by_name_before_any_weight(longrope, tmp_path, rope, message) -> None:
    path = _longrope_dir(longrope, tmp_path, **rope)
    with pytest.raises(ModelLoadError, match=message):
        load_model(path, torch.float32, "cpu")
    with pytest.raises(ModelLoadError, match=message):
        AsyncEngine.from_pretrained(path, **LONGROPE_OPTIONS)


@pytest.mark.parametrize(("extra", "message"), [
    ({"rope_factors_long.weight": np.full(5, 4.0, np.float32)},
     (r"GGUF tensor rope_factors_long\.weight is F32 \[5\], expected a float tensor of head_dim/2=8 values "
      r"\(longrope's long_factor\)")),
    ({"rope_factors_short.weight": None}, r"has no rope_factors_short\.weight \(longrope's short_factor"),
])
def test_a_gguf_with_bad_longrope_tensors_is_refused_from_its_header(longrope, tmp_path, no_weight_reads, extra,
                                                                     message) -> None:
    path = write_gguf(tmp_path / "bad.gguf", "phi3", longrope.hf, longrope.blocks, extra=extra)
    with pytest.raises(ModelLoadError, match=message):
        load_model(path, torch.float32, "cpu")


def test_a_gguf_with_a_nonpositive_longrope_factor_is_refused_reading_only_the_factors(longrope, tmp_path,
                                                                                      monkeypatch) -> None:
    short = np.array(LONGROPE["short_factor"], np.float32)
    short[2] = 0.0
    path = write_gguf(tmp_path / "zero.gguf", "phi3", longrope.hf, longrope.blocks,
                      extra={"rope_factors_short.weight": short})
    read = GGUFFile.dequantize
    names = []

    def only_the_factors(reader: GGUFFile, tensor: Any) -> torch.Tensor:
        names.append(tensor.name)
        assert tensor.name.startswith("rope_factors_"), f"{tensor.name} was read"
        return read(reader, tensor)

    monkeypatch.setattr(GGUFFile, "dequantize", only_the_factors)
    with pytest.raises(ModelLoadError, match=r"longrope rope: short_factor\[2\] must be a finite number > 0, got 0\.0"):
        AsyncEngine.from_pretrained(path, **LONGROPE_OPTIONS)
    assert sorted(set(names)) == ["rope_factors_long.weight", "rope_factors_short.weight"]
