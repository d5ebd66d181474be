"""Several named models in one engine: generators with their own KV caches, embedding models
with dynamic batching, add_model / remove_model, and the errors around them."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref

import pytest
import torch
import torch.nn.functional as F

import asyncinfer.loading
from asyncinfer import (
    AsyncEngine,
    ConfigurationError,
    EngineClosedError,
    InvalidParameterError,
    ModelLoadError,
    RequestAbortedError,
    SamplingParams,
)
from asyncinfer.models.encoder import load_encoder
from tests.helpers import ENGINE_BASE, greedy, hf_greedy, random_prompts

MAX_TOKENS = 16
TEXTS = [
    "The cat sat on the mat.",
    "A man is playing a guitar.",
    "Interest rates went up again this quarter.",
    "How do I reset my password?",
    "Paris is the capital of France.",
    "The quick brown fox jumps over the lazy dog.",
    "short",
    "A much longer sentence that goes on and on about nothing in particular, just to have a long one.",
]


PROMPTS = random_prompts(6, seed=5, max_len=30)


@pytest.fixture(scope="module")
def reference(tiny_models) -> dict[str, list[list[int]]]:
    """transformers' greedy tokens for every prompt on each tiny model."""
    out = {kind: [hf_greedy(tiny_models[kind][1], p, MAX_TOKENS) for p in PROMPTS] for kind in ("llama", "qwen2")}
    assert all(a != b for a, b in zip(out["llama"], out["qwen2"]))  # a mix-up would show
    return out


@pytest.fixture(scope="module")
def solo_vectors(minilm_dir) -> torch.Tensor:
    """Each text embedded alone by the encoder, outside any engine."""
    enc = load_encoder(minilm_dir, torch.float32, "cpu")
    return torch.cat([enc.encode([t]) for t in TEXTS])


def assert_same_vectors(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert F.cosine_similarity(got, want, dim=-1).min().item() >= 1 - 1e-5


async def test_generators_and_an_embedder_serve_side_by_side(tiny_models, minilm_dir, reference, solo_vectors):
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], name="chat", **ENGINE_BASE)
    async with engine:
        qwen = await engine.add_model("qwen", tiny_models["qwen2"][0],
                                      **{**ENGINE_BASE, "kv_cache_memory": 2 * 1024 * 1024})
        emb = await engine.add_model("minilm", "all-MiniLM-L6-v2", max_batch_size=4, max_wait_ms=2)
        assert (qwen.name, qwen.kind, emb.name, emb.kind) == ("qwen", "generate", "minilm", "embed")
        # Each generator has its own share: the KV cache it was given.
        info = {i.name: i for i in engine.model_info()}
        assert list(info) == ["chat", "qwen", "minilm"]
        assert info["chat"].memory_plan.kv_budget_bytes == 4 * 1024 * 1024
        assert info["qwen"].memory_plan.kv_budget_bytes == 2 * 1024 * 1024
        assert info["minilm"].memory_plan.max_batch_size == 4

        default, named_chat, named_qwen, vectors, one = await asyncio.gather(
            asyncio.gather(*(engine.generate(p, greedy(MAX_TOKENS)) for p in PROMPTS)),
            asyncio.gather(*(engine.generate(p, greedy(MAX_TOKENS), model="chat") for p in PROMPTS)),
            asyncio.gather(*(engine.generate(p, greedy(MAX_TOKENS), model="qwen") for p in PROMPTS)),
            asyncio.gather(*(engine.embed(t, model="minilm") for t in TEXTS)),
            engine.embed(TEXTS),  # default embedder, all texts in one call
        )
        assert [o.token_ids for o in default] == reference["llama"]  # the first loaded is the default
        assert [o.token_ids for o in named_chat] == reference["llama"]
        assert [o.token_ids for o in named_qwen] == reference["qwen2"]
        assert_same_vectors(torch.cat(vectors), solo_vectors)
        assert_same_vectors(one, solo_vectors)
        streamed = [d async for d in engine.stream(PROMPTS[0], greedy(MAX_TOKENS), model="qwen")]
        assert [t for d in streamed for t in d.token_ids] == reference["qwen2"][0]
        assert engine.kv_stats("qwen").used_blocks == 0
        stats = engine.embedding_stats()
        assert stats.num_texts == 2 * len(TEXTS) and max(stats.batch_sizes) <= 4


async def test_remove_model_finishes_its_requests_then_frees_it(tiny_models, reference):
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], name="a", **ENGINE_BASE)
    async with engine:
        await engine.add_model("b", tiny_models["qwen2"][0], **ENGINE_BASE)
        core_ref = weakref.ref(engine.core)  # "a" is the default generator
        in_flight = [asyncio.create_task(engine.generate(p, greedy(MAX_TOKENS), model="a")) for p in PROMPTS]
        await asyncio.sleep(0)  # submitted before the removal
        await asyncio.sleep(0.05)
        await engine.remove_model("a")
        assert [t.result().token_ids for t in in_flight] == reference["llama"]  # finished, on "a"
        with pytest.raises(InvalidParameterError) as err:
            await engine.generate(PROMPTS[0], greedy(MAX_TOKENS), model="a")
        assert err.value.parameter == "model"
        # "b" is the default generator now.
        out = await engine.generate(PROMPTS[1], greedy(MAX_TOKENS))
        assert out.token_ids == reference["qwen2"][1]
        assert [(i.name, i.state) for i in engine.model_info()] == [("b", "current")]
        gc.collect()
        assert core_ref() is None  # weights, KV tensors and prefix cache are gone


async def test_remove_model_with_abort_ends_its_requests(tiny_models):
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE)
    async with engine:
        await engine.add_model("b", tiny_models["qwen2"][0], **ENGINE_BASE)
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        tasks = [asyncio.create_task(engine.generate(p, long, model="b")) for p in PROMPTS]
        # Removed once its requests run: a fixed 0.2 s wait let all 200 tokens finish on a fast machine.
        while engine.step_stats("b").steps < 2:
            await asyncio.sleep(0.005)
        await engine.remove_model("b", abort=True)
        outs = [await t for t in tasks]
        assert all(o.finish_reason == "abort" for o in outs)
        assert all(len(o.token_ids) < 200 for o in outs)
        assert [i.name for i in engine.model_info()] == ["default"]


async def test_swap_model_by_name_leaves_the_other_models_alone(tiny_models, reference):
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], name="a", **ENGINE_BASE)
    async with engine:
        await engine.add_model("b", tiny_models["llama"][0], **ENGINE_BASE)
        info = await engine.swap_model(tiny_models["qwen2"][0], name="b")
        assert info.name == "b"
        a, b = await asyncio.gather(engine.generate(PROMPTS[2], greedy(MAX_TOKENS), model="a"),
                                    engine.generate(PROMPTS[2], greedy(MAX_TOKENS), model="b"))
        assert a.token_ids == reference["llama"][2]
        assert b.token_ids == reference["qwen2"][2]


async def test_add_model_refusals_leave_the_engine_as_it_was(tiny_models, minilm_dir, reference, tmp_path):
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE)
    async with engine:
        before = engine.model_info()
        with pytest.raises(InvalidParameterError) as err:
            await engine.add_model("default", tiny_models["qwen2"][0], **ENGINE_BASE)
        assert err.value.parameter == "name"
        with pytest.raises(InvalidParameterError):
            await engine.add_model("", tiny_models["qwen2"][0], **ENGINE_BASE)
        with pytest.raises(ConfigurationError, match="does not fit beside the loaded models"):
            await engine.add_model("big", tiny_models["qwen2"][0], available_bytes=1024 * 1024, **ENGINE_BASE)
        with pytest.raises(ConfigurationError, match="embedding model does not fit"):
            await engine.add_model("emb", minilm_dir, available_bytes=1024 * 1024)
        with pytest.raises(InvalidParameterError) as err:
            await engine.add_model("emb", minilm_dir, kv_cache_memory=1024)  # a generator option
        assert err.value.parameter == "kv_cache_memory"
        with pytest.raises(InvalidParameterError) as err:
            await engine.add_model("emb", minilm_dir, max_batch_size=0)
        assert err.value.parameter == "max_batch_size"
        with pytest.raises(InvalidParameterError) as err:
            await engine.add_model("emb", minilm_dir, max_seq_len=4096)
        assert err.value.parameter == "max_seq_len"
        with pytest.raises(ModelLoadError):
            await engine.add_model("gone", tmp_path / "no-such-model")
        with pytest.raises(InvalidParameterError):
            await engine.remove_model("never-added")
        assert engine.model_info() == before
        out = await engine.generate(PROMPTS[0], greedy(MAX_TOKENS))
        assert out.token_ids == reference["llama"][0]


async def test_embed_argument_errors(tiny_models, minilm_dir, solo_vectors):
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE)
    async with engine:
        with pytest.raises(InvalidParameterError) as err:
            await engine.embed("hello")
        assert str(err.value) == ("no model was named and this engine holds no embedding model to default to: "
                                  "add an embedding model with add_model(), or name one it holds")
        await engine.add_model("emb", minilm_dir)
        for bad, parameter in (([], "texts"), ([1], "texts[0]"), (None, "texts"), (["a", b"b"], "texts[1]")):
            with pytest.raises(InvalidParameterError) as err:
                await engine.embed(bad)
            assert err.value.parameter == parameter
        with pytest.raises(InvalidParameterError, match="use generate"):
            await engine.embed("hello", model="default")
        with pytest.raises(InvalidParameterError, match="use embed"):
            await engine.generate("hello", model="emb")
        assert engine.embedding_stats().num_calls == 0
        assert_same_vectors(await engine.embed(TEXTS[0]), solo_vectors[:1])


async def test_dynamic_batching_groups_concurrent_calls(minilm_dir, solo_vectors):
    engine = AsyncEngine.from_pretrained(minilm_dir, max_batch_size=8, max_wait_ms=500)
    async with engine:
        start = time.perf_counter()
        vectors = await asyncio.gather(*(engine.embed(t) for t in TEXTS))  # 8 texts: a full batch
        full = time.perf_counter() - start
        stats = engine.embedding_stats()
        assert (stats.num_calls, stats.num_batches, stats.batch_sizes) == (8, 1, {8: 1})
        assert full < 0.5  # a full batch does not wait for max_wait_ms
        assert_same_vectors(torch.cat(vectors), solo_vectors)
        # A lone text waits max_wait_ms for company, then runs alone.
        start = time.perf_counter()
        await engine.embed("alone")
        assert time.perf_counter() - start >= 0.45
        assert engine.embedding_stats().batch_sizes == {1: 1, 8: 1}


async def test_batching_off_runs_every_text_alone(minilm_dir, solo_vectors):
    engine = AsyncEngine.from_pretrained(minilm_dir, max_batch_size=1)
    async with engine:
        vectors = await asyncio.gather(*(engine.embed(t) for t in TEXTS))
        stats = engine.embedding_stats()
        assert (stats.num_batches, stats.batch_sizes) == (8, {1: 8})
        assert_same_vectors(torch.cat(vectors), solo_vectors)
        with pytest.raises(InvalidParameterError):
            await engine.generate("hi")  # an embedding-only engine has no generator


async def test_cancelled_embed_is_dropped_and_nothing_leaks(minilm_dir, solo_vectors):
    engine = AsyncEngine.from_pretrained(minilm_dir, max_batch_size=32, max_wait_ms=300)
    async with engine:
        task = asyncio.create_task(engine.embed(["a", "b", "c"]))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.4)
        assert engine.embedding_stats().num_batches == 0  # its texts were never computed
        assert engine.model_info()[0].requests_in_flight == 0
        assert_same_vectors(await engine.embed([TEXTS[1]]), solo_vectors[1:2])


async def test_close_flushes_or_aborts_waiting_embeds(minilm_dir, solo_vectors):
    engine = AsyncEngine.from_pretrained(minilm_dir, max_wait_ms=1000)
    await engine.start()
    task = asyncio.create_task(engine.embed(TEXTS[2]))  # flushed at close
    await asyncio.sleep(0.05)
    start = time.perf_counter()
    await engine.aclose()
    assert_same_vectors(await task, solo_vectors[2:3])
    assert time.perf_counter() - start < 0.9  # closing ran the batch without waiting it out
    with pytest.raises(EngineClosedError):
        await engine.embed("after close")

    engine = AsyncEngine.from_pretrained(minilm_dir, max_wait_ms=1000)
    await engine.start()
    task = asyncio.create_task(engine.embed("aborted"))
    await asyncio.sleep(0.05)
    await engine.aclose(abort=True)
    with pytest.raises(RequestAbortedError):
        await task


def capture_encoders(monkeypatch) -> list:
    """Every encoder the engine loads from now on (a handle for the test, nothing else changes)."""
    loaded = []

    def load_and_keep(*args, **kwargs):
        encoder = load_encoder(*args, **kwargs)
        loaded.append(encoder)
        return encoder

    monkeypatch.setattr(asyncinfer.loading, "load_encoder", load_and_keep)
    return loaded


async def test_remove_embedding_model_drains_or_aborts(tiny_models, minilm_dir, solo_vectors, monkeypatch):
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE)
    encoders = capture_encoders(monkeypatch)
    async with engine:
        await engine.add_model("emb", minilm_dir, max_wait_ms=300)
        model_ref = weakref.ref(encoders.pop().model)
        task = asyncio.create_task(engine.embed(TEXTS[3]))  # finishes first
        await asyncio.sleep(0.05)
        await engine.remove_model("emb")
        assert_same_vectors(await task, solo_vectors[3:4])
        gc.collect()
        assert model_ref() is None
        with pytest.raises(InvalidParameterError):
            await engine.embed("gone", model="emb")

        await engine.add_model("emb", minilm_dir, max_wait_ms=1000)
        task = asyncio.create_task(engine.embed("aborted"))
        await asyncio.sleep(0.05)
        await engine.remove_model("emb", abort=True)
        with pytest.raises(RequestAbortedError):
            await task
        assert [i.name for i in engine.model_info()] == ["default"]


def test_plan_memory_of_an_embedding_model_before_loading(minilm_dir):
    plan = AsyncEngine.plan_memory(minilm_dir, max_batch_size=8, max_seq_len=128, dtype="float32", device="cpu")
    encoder = load_encoder(minilm_dir, torch.float32, "cpu")
    assert plan.weight_bytes == encoder.weight_bytes  # estimated from config.json alone
    assert (plan.max_batch_size, plan.max_seq_len) == (8, 128)
    assert plan.activation_bytes == encoder.config.activation_bytes(8, 128, 4)
    with pytest.raises(ConfigurationError, match="does not fit"):
        AsyncEngine.plan_memory(minilm_dir, available_bytes=10 * 1024 * 1024)
    with pytest.raises(InvalidParameterError) as err:
        AsyncEngine.plan_memory(minilm_dir, block_size=16)
    assert err.value.parameter == "block_size"


def test_cli_embed_prints_the_engines_vectors(minilm_dir, solo_vectors, capsys):
    import json

    from asyncinfer import cli

    assert cli.main(["embed", *TEXTS[:3], "--model", str(minilm_dir), "--device", "cpu", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["texts"] == TEXTS[:3]
    assert_same_vectors(torch.tensor(printed["embeddings"]), solo_vectors[:3])
    assert cli.main(["embed", "a", "b", "--model", str(minilm_dir), "--device", "cpu"]) == 0
    assert "cosine similarity" in capsys.readouterr().out


async def test_a_failing_embedding_batch_fails_its_calls_and_the_engine_keeps_serving(tiny_models, minilm_dir,
                                                                                         reference, solo_vectors,
                                                                                         monkeypatch):
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE)
    encoders = capture_encoders(monkeypatch)
    async with engine:
        await engine.add_model("emb", minilm_dir, max_batch_size=1)
        encoder = encoders.pop()
        real = encoder.encode_ids

        def fail_once(batch):
            encoder.encode_ids = real
            raise RuntimeError("simulated device failure")

        encoder.encode_ids = fail_once
        with pytest.raises(RequestAbortedError) as err:
            await engine.embed("first")
        assert isinstance(err.value.__cause__, RuntimeError)
        assert_same_vectors(await engine.embed(TEXTS[4]), solo_vectors[4:5])
        out = await engine.generate(PROMPTS[0], greedy(MAX_TOKENS))
        assert out.token_ids == reference["llama"][0]


async def test_an_embedding_only_engine_can_add_a_generator(tiny_models, minilm_dir, reference, solo_vectors):
    engine = AsyncEngine.from_pretrained(minilm_dir, name="emb")
    async with engine:
        with pytest.raises(InvalidParameterError, match="holds no generator to default to: add a generator"):
            await engine.generate(PROMPTS[0], greedy(MAX_TOKENS))
        await engine.add_model("gen", tiny_models["qwen2"][0], **ENGINE_BASE)
        out, vec = await asyncio.gather(engine.generate(PROMPTS[3], greedy(MAX_TOKENS)), engine.embed(TEXTS[5]))
        assert out.token_ids == reference["qwen2"][3]
        assert_same_vectors(vec, solo_vectors[5:6])
        assert [(i.name, i.kind) for i in engine.model_info()] == [("gen", "generate"), ("emb", "embed")]


async def test_one_tenants_many_embed_calls_do_not_hold_back_anothers(minilm_dir, solo_vectors):
    """The batches took one text of each waiting call in turn: a tenant with 40 calls queued had 40 places in a
    round to another tenant's one, whose call ran in the eleventh batch of four. Now the turns go tenant by tenant
    (``embed(tenant=...)``): the other tenant's call rides in the first batch."""
    text = TEXTS[0]  # 9 tokens ([CLS] the cat sat on the mat . [SEP]): four fill 36 token slots
    # no batch is due before a second has passed, by when every call below is queued
    engine = AsyncEngine.from_pretrained(minilm_dir, max_batch_size=64, max_wait_ms=1000, max_batch_tokens=36)
    async with engine:
        finished: list[str] = []

        async def embed(name: str, tenant: str | None) -> torch.Tensor:
            vectors = await engine.embed(text, tenant=tenant)
            finished.append(name)
            return vectors

        calls = [embed(f"a{i}", "a") for i in range(40)] + [embed("b", "b")]
        vectors = await asyncio.gather(*calls)
        assert finished[:4] == ["a0", "b", "a1", "a2"]  # the first batch: a's turn, b's, then a's calls in turn
        stats = engine.embedding_stats()
        assert (stats.num_calls, stats.num_texts, stats.batch_sizes) == (41, 41, {1: 1, 4: 10})
        assert_same_vectors(torch.cat(vectors), solo_vectors[:1].expand(41, -1))


@pytest.mark.parametrize(("bad", "shown"), [(5, 5), ("", ""), ("x" * 129, "<129 chars>"), ("a\nb", "a\nb"),
                                            (b"acme", b"acme")])
async def test_embed_refuses_a_bad_tenant_by_name(minilm_dir, bad, shown):
    engine = AsyncEngine.from_pretrained(minilm_dir)
    async with engine:
        with pytest.raises(InvalidParameterError) as err:
            await engine.embed("hello", tenant=bad)
        assert (err.value.parameter, err.value.value) == ("tenant", shown)
        assert "None or a string of 1 to 128 printable characters" in str(err.value)
        assert engine.embedding_stats().num_calls == 0
        assert (await engine.embed("hello", tenant="x" * 128)).shape == (1, 384)
