"""Sliding windows and the Gemma families through the public engine (issue 23, item 3).

Each windowed tiny model (Mistral and ``qwen2_window_all``: every layer; Qwen2: its second layer; Gemma 2
and Gemma 3: alternating) serves prompts longer than its window, with a context of its own length (the
models whose every layer slides giving back the KV blocks before each request's window, the others none),
and its greedy tokens equal transformers' ``generate()`` on the torch reference decode and on the backend
``select_decode_backend`` picks for a GGUF in Q8_0 blocks (Gemma: the kernels' one-call decode step at any
context, its sliding layers' windows in the kernel; Mistral as a ``llama`` GGUF: the one-call step while
every context fits in the window, the reference past it). Gemma's chat turns render through
``prompts.py`` with a Hugging Face tokenizer and with the one transformers builds from a Gemma GGUF,
and ``<end_of_turn>`` ends a reply.
"""

from __future__ import annotations

import asyncio
import json

import gguf
import pytest
import torch

from asyncinfer import AsyncEngine, InvalidParameterError, kernels
from asyncinfer.models.decode_backends import KernelDecode, TorchDecode, kernel_decode_blocker
from asyncinfer.models.llama import LLAMA_WEIGHT_MAP
from asyncinfer.models.quant import BlockEmbedding, BlockLinear
from tests.helpers import (
    ENGINE_BASE,
    TINY_WINDOW,
    gguf_names,
    greedy,
    hf_greedy,
    random_prompts,
    tiny_hf_model,
    write_gemma_gguf,
)

WINDOWED = ["mistral_window", "qwen2_window_all", "qwen2_window", "gemma2", "gemma3"]
EVERY_LAYER_SLIDES = {"mistral_window", "qwen2_window_all"}


def reference(kind: str, seed: int = 5) -> torch.nn.Module:
    hf = tiny_hf_model(kind, seed)
    hf.generation_config.eos_token_id = None  # hf_greedy's references run to their length
    hf.generation_config.pad_token_id = 0
    return hf


async def serve(source, prompts: list[list[int]], lengths: list[int], **options) -> tuple[AsyncEngine, list]:
    engine = AsyncEngine.from_pretrained(source, **{**ENGINE_BASE, "max_num_batched_tokens": 16, **options})
    async with engine:
        outs = await asyncio.gather(*(engine.generate(p, greedy(n)) for p, n in zip(prompts, lengths)))
    return engine, [out.token_ids for out in outs]


@pytest.mark.parametrize("kind", WINDOWED)
async def test_greedy_tokens_past_the_window_equal_transformers(kind, tmp_path) -> None:
    hf = reference(kind)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    prompts = random_prompts(3, seed=9, max_len=30, vocab=256)
    prompts[0] = prompts[0] + prompts[1]  # at least one prompt far past the window
    lengths = [14, 20, 9]
    engine, got = await serve(tmp_path, prompts, lengths)
    assert engine.max_model_len == ENGINE_BASE["max_model_len"] > TINY_WINDOW  # the context is not the window
    assert isinstance(engine.core.runner.decode, TorchDecode)
    assert max(map(len, prompts)) > 3 * TINY_WINDOW
    for p, n, tokens in zip(prompts, lengths, got):
        assert tokens == hf_greedy(hf, p, n)
    # Blocks wholly before a window went back while the requests decoded (prefix caching on: prompts[0]
    # starts with prompts[1]), only where no layer attends to the whole context.
    stats = engine.kv_stats()
    assert (stats.window_releases > 0) == (kind in EVERY_LAYER_SLIDES) and stats.used_blocks == 0


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
async def test_a_gemma_gguf_in_blocks_decodes_on_the_kernel_step_and_matches(kind, tmp_path, monkeypatch) -> None:
    assert kernels.available(), kernels.unavailable_reason()
    hf = reference(kind)
    path = write_gemma_gguf(hf, tmp_path / f"{kind}.gguf", q8=True)  # hf now holds the stored values
    engine = AsyncEngine.from_pretrained(path, **{**ENGINE_BASE, "max_num_batched_tokens": 16}, quantization="q8_0")
    decode = engine.core.runner.decode
    assert isinstance(decode, KernelDecode) and decode.attention.name == "sdpa-kernel-decode"
    assert kernel_decode_blocker(decode.model) is None
    assert isinstance(decode.model.layers[0].attn.qkv_proj, BlockLinear)  # the file's own Q8_0 blocks
    embedding = decode.model.embed_tokens  # tied: the embedding reads the head's Q8_0 blocks, scaled in float32
    assert isinstance(embedding, BlockEmbedding) and embedding.shared and embedding.fmt == "q8_0"
    prompts = [[5, 9, 14], *random_prompts(2, seed=4, max_len=26, vocab=256)]
    layer_of = {k.data_ptr(): i for i, (k, _) in enumerate(engine.core.runner.kv_caches)}
    # (layer, longest context, window, softcap) of each decode attention the kernel ran in a mixed step
    in_kernel: list[tuple[int, int, int | None, float | None]] = []
    attend = kernels.decode_attention
    monkeypatch.setattr(kernels, "decode_attention",
                        lambda q, kc, vc, tables, lens, scale, **kw: in_kernel.append(
                            (layer_of[kc.data_ptr()], int(lens.max()), kw.get("window"), kw.get("softcap")))
                        or attend(q, kc, vc, tables, lens, scale, **kw))
    kernel_contexts: list[int] = []  # the context lengths of the steps the one-call kernel step ran
    run_step = decode.stack.decode_packed

    def counted(packed, num_tokens, *args):  # the step's context lengths sit at [3n, 4n) of its integers
        kernel_contexts.extend(packed[3 * num_tokens : 4 * num_tokens])
        return run_step(packed, num_tokens, *args)

    monkeypatch.setattr(decode.stack, "decode_packed", counted)
    async with engine:
        # Alone: the kernel step, within the window and past it.
        short = await engine.generate(prompts[0], greedy(5))
        # Mixed steps, whatever the machine's speed: the second prompt (20 tokens, over the 16-token step
        # budget) is submitted once the first decodes, and the first decodes until the second is done, so
        # the second's chunks share steps with the first's decodes.
        decoding, done = asyncio.Event(), asyncio.Event()

        async def first() -> list[int]:
            tokens: list[int] = []
            async for delta in engine.stream(prompts[1], greedy(200)):
                tokens += delta.token_ids
                decoding.set()
                if done.is_set():
                    break
            return tokens

        task = asyncio.create_task(first())
        await decoding.wait()
        second = await engine.generate(prompts[2], greedy(12))
        done.set()
        running = await task
    assert short.token_ids == hf_greedy(hf, prompts[0], 5)
    assert len(running) < 200 and running == hf_greedy(hf, prompts[1], len(running))
    assert second.token_ids == hf_greedy(hf, prompts[2], 12)
    assert kernel_contexts and max(kernel_contexts) > 2 * TINY_WINDOW  # the sliding layers' windows in the kernel
    # The decodes of a mixed step attend in the kernel too, past the window and with capped scores.
    sliding = {layer for layer, _, window, _ in in_kernel if window is not None}
    assert sliding == ({0, 2} if kind == "gemma3" else {0})  # gemma3: layers 0 and 2 slide; gemma2: the even ones
    assert max(ctx for layer, ctx, window, _ in in_kernel if layer in sliding) > TINY_WINDOW
    caps = {cap for *_, cap in in_kernel}
    assert caps == ({None} if kind == "gemma3" else {hf.config.attn_logit_softcapping})


def write_llama_gguf(hf: torch.nn.Module, path, window: int):
    """A Mistral as llama.cpp writes it: a ``llama`` GGUF with permuted q/k rows, its window in
    ``llama.attention.sliding_window``, every matrix in Q8_0 (``hf`` given the stored values)."""
    cfg = hf.config
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_block_count, cfg.num_hidden_layers), (writer.add_vocab_size, cfg.vocab_size),
                       (writer.add_context_length, cfg.max_position_embeddings),
                       (writer.add_embedding_length, cfg.hidden_size),
                       (writer.add_feed_forward_length, cfg.intermediate_size),
                       (writer.add_head_count, cfg.num_attention_heads),
                       (writer.add_head_count_kv, cfg.num_key_value_heads), (writer.add_sliding_window, window)):
        add(value)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    names = gguf_names(LLAMA_WEIGHT_MAP, cfg.num_hidden_layers)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            data, dtype = p.numpy().copy(), None
            if p.dim() == 2:
                data = gguf.quants.quantize(p.numpy(), gguf.GGMLQuantizationType.Q8_0)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q8_0)))
                dtype = gguf.GGMLQuantizationType.Q8_0
            if name.endswith(("q_proj.weight", "k_proj.weight")):  # llama.cpp's rope row permutation
                heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
                rows = p.shape[0]
                perm = torch.arange(rows).view(heads, 2, rows // heads // 2).transpose(1, 2).reshape(-1)
                data = data[perm.numpy()]
            writer.add_tensor(names[name], data, raw_dtype=dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


async def test_a_windowed_llama_gguf_decodes_past_its_window_on_the_kernel_step(tmp_path, monkeypatch) -> None:
    """A Mistral-style GGUF (a window on every layer) in Q8_0: its decode steps run the kernels' one-call step
    within the window and past it (each layer attends to its last TINY_WINDOW keys there, as transformers masks
    them), and its greedy tokens are transformers' token for token."""
    assert kernels.available(), kernels.unavailable_reason()
    hf = reference("mistral_window")
    path = write_llama_gguf(hf, tmp_path / "mistral.gguf", TINY_WINDOW)
    engine = AsyncEngine.from_pretrained(path, **{**ENGINE_BASE, "max_num_batched_tokens": 16}, quantization="q8_0")
    decode = engine.core.runner.decode
    assert isinstance(decode, KernelDecode) and kernel_decode_blocker(decode.model) is None
    assert [layer._args["window"] for layer in decode.stack.layers] == [TINY_WINDOW] * len(decode.stack.layers)
    kernel_contexts: list[int] = []
    run_step = decode.stack.decode_packed

    def counted(packed, num_tokens, *args):  # the step's context lengths sit at [3n, 4n) of its integers
        kernel_contexts.extend(packed[3 * num_tokens : 4 * num_tokens])
        return run_step(packed, num_tokens, *args)

    monkeypatch.setattr(decode.stack, "decode_packed", counted)
    prompts = [[5, 9, 14], random_prompts(1, seed=8, max_len=30, vocab=256)[0]]
    async with engine:
        short = await engine.generate(prompts[0], greedy(3 * TINY_WINDOW))  # contexts 4 .. 3 windows
        both = await asyncio.gather(*(engine.generate(p, greedy(10)) for p in prompts))
    assert short.token_ids == hf_greedy(hf, prompts[0], 3 * TINY_WINDOW)
    for p, out in zip(prompts, both):
        assert out.token_ids == hf_greedy(hf, p, 10)
    assert max(kernel_contexts) > 2 * TINY_WINDOW  # the kernel step ran past the window
    assert engine.kv_stats().window_releases > 0  # its tables held released entries there


# ---- Gemma's chat turns ---------------------------------------------------------------------------

# Gemma's turn format (as its model cards document it): "<bos>", then per message
# "<start_of_turn>{user|model}\n{content}<end_of_turn>\n", a system message folded into the first user
# turn, roles that must alternate; the generation prompt opens a model turn.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(prefix='') %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.prefix = m['content'] + '\\n\\n' %}"
    "{% else %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == (1 if messages[0]['role'] == 'system' else 0)) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\\n' + ns.prefix + m['content'] "
    "+ '<end_of_turn>\\n' }}{% set ns.prefix = '' %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


def gemma_tokenizer(path) -> None:
    """A word-level tokenizer with Gemma's special tokens at Gemma's places (0 pad, 1 eos, 2 bos,
    106/107 the turn markers), its chat template, saved into ``path``."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<start_of_turn>": 106, "<end_of_turn>": 107}
    words = ["user", "model", "hello", "there", "be", "brief", "\n"]
    vocab = {**special, **{w: 110 + i for i, w in enumerate(words)}, "<unk>": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex("\n"), behavior="isolated"),
                                                 pre_tokenizers.Split(" ", behavior="removed")])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", additional_special_tokens=["<start_of_turn>", "<end_of_turn>"])
    fast.chat_template = GEMMA_TEMPLATE
    fast.save_pretrained(path)


async def test_gemma_chat_turns_render_and_end_of_turn_ends_a_reply(tmp_path) -> None:
    hf = tiny_hf_model("gemma2", seed=3, bos_token_id=2, eos_token_id=1)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 107]}))  # as Gemma ships it
    gemma_tokenizer(tmp_path)
    engine = AsyncEngine.from_pretrained(tmp_path, **ENGINE_BASE)
    async with engine:
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
        out = await engine.generate(messages, greedy(4))
        with pytest.raises(InvalidParameterError, match="roles must alternate"):
            await engine.generate([{"role": "user", "content": "hello"}, {"role": "user", "content": "hello"}],
                                  greedy(2))
    # <bos> <start_of_turn> user \n be brief \n \n hello there <end_of_turn> \n <start_of_turn> model \n
    assert out.prompt_token_ids == [2, 106, 110, 116, 114, 115, 116, 116, 112, 113, 107, 116, 106, 111, 116]
    assert len(out.token_ids) == 4
    assert 107 in engine.core.eos_token_ids and 1 in engine.core.eos_token_ids


async def test_a_gemma_gguf_brings_its_tokenizer_and_chat_template(tmp_path, monkeypatch) -> None:
    """The tokenizer transformers builds from a Gemma GGUF renders and encodes chat turns; ``<end_of_turn>``
    (found by its spelling in the vocabulary, as llama.cpp finds it) ends replies."""
    monkeypatch.setenv("ASYNCINFER_CACHE_DIR", str(tmp_path / "cache"))  # the built tokenizer's cache
    vocab = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "\u2581", "\n",
             *"abdefhilmnorstuy", "us", "er", "user", "mo", "de", "model", "he", "ll", "hell", "hello",
             "\u2581t", "\u2581the", "\u2581ther", "\u2581there", "be", "\u2581b", "\u2581be", "\u2581brief"]
    hf = tiny_hf_model("gemma3", 5, bos_token_id=2, eos_token_id=1)  # Gemma's ids
    hf.generation_config.eos_token_id, hf.generation_config.pad_token_id = None, 0  # references run to length
    path = write_gemma_gguf(hf, tmp_path / "gemma3.gguf", vocab=vocab, chat_template=GEMMA_TEMPLATE)
    engine = AsyncEngine.from_pretrained(path, **ENGINE_BASE)
    assert engine.core.eos_token_ids == frozenset({hf.config.eos_token_id, vocab.index("<end_of_turn>")})
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    async with engine:
        out = await engine.generate(messages, greedy(3))
    tokenizer = engine.tokenizer
    assert tokenizer.chat_template == GEMMA_TEMPLATE
    text = "<bos><start_of_turn>user\nbe brief\n\nhello there<end_of_turn>\n<start_of_turn>model\n"
    ids = out.prompt_token_ids
    assert ids[:2] == [2, 4] and ids.count(4) == 2 and ids.count(5) == 1 and ids.count(2) == 1
    assert tokenizer.decode(ids) == text and vocab.index("user") in ids  # the file's own pieces
    assert out.token_ids == hf_greedy(hf, ids, 3)
