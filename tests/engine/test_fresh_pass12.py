"""Adversarial pass 12 (in-process side): faults a hostile or careless caller sharing one engine could cause, found
and fixed."""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncinfer import AsyncEngine, InvalidParameterError, SamplingParams
from tests.helpers import loop_lags, save_tiny_bert

BASE = {
    "kv_cache_memory": 4 * 1024 * 1024,
    "max_model_len": 512,
    "dtype": "float32",
    "device": "cpu",
    "block_size": 4,
    "num_threads": 1,
}
GOOD = [(29 * j) % 300 + 7 for j in range(9)]


@pytest.fixture(scope="module")
def llama(tiny_models):
    return tiny_models["llama"][0]


# ----------------------------------------------------------------- num_threads is bounded
def test_num_threads_past_max_threads_is_an_invalid_parameter_at_every_entry(llama, capsys) -> None:
    """``num_threads=20000`` was taken as it was and handed to ``torch.set_num_threads`` at the load, where OpenMP
    aborted the whole process (no exception to catch, every other caller's requests gone with it). It is bounded
    by ``MAX_THREADS`` (4096) now: an InvalidParameterError naming ``num_threads`` and the range, from the config,
    ``from_pretrained``, ``load``, an embedding model's options and the command line's ``--threads``; torch's
    thread count is left as it was."""
    from asyncinfer import cli
    from asyncinfer.config import MAX_THREADS, EngineConfig
    from asyncinfer.embedding import EmbeddingConfig

    assert MAX_THREADS == 4096
    before = torch.get_num_threads()
    for config in (EngineConfig, EmbeddingConfig):
        with pytest.raises(InvalidParameterError) as info:
            config(num_threads=20000)
        assert (info.value.parameter, info.value.value, info.value.allowed) == (
            "num_threads", 20000, "an integer in [1, 4096]")
        assert config(num_threads=MAX_THREADS).num_threads == MAX_THREADS  # the bound itself is taken
    with pytest.raises(InvalidParameterError) as info:
        AsyncEngine.from_pretrained(llama, **{**BASE, "num_threads": MAX_THREADS + 1})
    assert info.value.parameter == "num_threads"
    with pytest.raises(InvalidParameterError) as info:
        asyncio.run(AsyncEngine.load(llama, **{**BASE, "num_threads": 20000}))
    assert info.value.parameter == "num_threads"
    assert cli.main(["generate", str(llama), "--prompt", "x", "--threads", "20000"]) == 2
    assert "--threads 20000 is invalid: allowed an integer in [1, 4096]" in capsys.readouterr().err
    assert torch.get_num_threads() == before


# ----------------------------------------------------------------- remove_model retires draining versions too
@pytest.mark.parametrize("abort", [False, True], ids=["drain", "abort"])
async def test_remove_model_after_an_overlapping_swap_ends_the_old_versions_requests(llama, abort) -> None:
    """After an overlapping swap (the new version serving while the old one still drains requests),
    ``remove_model`` retired only the serving version and then stopped stepping the model: the requests on the
    draining old version never ended, their callers waiting forever. The removal retires every live version now,
    as it promises: their requests finish (``abort=False``) or end with ``finish_reason="abort"``
    (``abort=True``), and the model is gone."""
    long, short = SamplingParams(max_tokens=300, ignore_eos=True), SamplingParams(max_tokens=20, ignore_eos=True)
    async with AsyncEngine.from_pretrained(llama, **BASE) as engine:
        await engine.add_model("second", llama, **BASE)
        old = asyncio.ensure_future(engine.generate(GOOD, long, model="second"))
        while engine.step_stats("second").steps < 2:
            await asyncio.sleep(0.01)
        await engine.swap_model(llama, name="second")  # overlap: the old version drains `old`
        new = asyncio.ensure_future(engine.generate(GOOD, short, model="second"))  # ends first
        await asyncio.sleep(0)
        assert [i.state for i in engine.model_info() if i.name == "second"] == ["draining", "current"]
        await asyncio.wait_for(engine.remove_model("second", abort=abort), 60)
        outs = await asyncio.wait_for(asyncio.gather(old, new), 5)
        if abort:
            assert [o.finish_reason for o in outs] == ["abort", "abort"]
            assert len(outs[0].token_ids) < 300 and len(outs[1].token_ids) < 20
        else:
            assert [o.finish_reason for o in outs] == ["length", "length"]
            assert [len(o.token_ids) for o in outs] == [300, 20]
            assert outs[0].token_ids[:20] == outs[1].token_ids  # the same weights, greedy
        assert [i.name for i in engine.model_info()] == ["default"]
        assert len(engine._link.thread._holders) == 1
        out = await asyncio.wait_for(engine.generate(GOOD, SamplingParams(max_tokens=3)), 30)
        assert len(out.token_ids) == 3


# ----------------------------------------------------------------- `asyncinfer generate` goes through admission
def test_the_generate_command_runs_through_the_engines_admission_control(llama, tmp_path, capsys) -> None:
    """``asyncinfer generate`` runs its requests in-process through ``engine.generate``, so the engine's admission
    limits hold for it as for the API: with ``--max-num-seqs 1 --max-waiting-requests 0`` the requests sent beside
    the first one are refused. Such a refusal (``EngineOverloadedError``) used to end the whole job (exit status 2,
    the request already running aborted); it is that request's ``error`` now, in the flags' terms, and the job goes
    on (exit status 1). Within the limits every request runs."""
    import json

    from asyncinfer import cli

    prompts = tmp_path / "in.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": [5 + i, 6, 7, 8], "id": f"q{i}"}) + "\n" for i in range(3)))
    flags = ["--file", str(prompts), "--max-tokens", "4", "--ignore-eos", "--max-num-seqs", "1",
             "--kv-cache-memory", "4MiB", "--threads", "1", "--dtype", "float32", "--no-progress"]
    out = tmp_path / "out.jsonl"
    assert cli.main(["generate", str(llama), *flags, "--max-waiting-requests", "0", "--output", str(out)]) == 1
    first, *refused = [json.loads(line) for line in out.read_text().splitlines()]
    assert (first["id"], first["finish_reason"], first["completion_tokens"]) == ("q0", "length", 4)
    assert [r["id"] for r in refused] == ["q1", "q2"]
    for record in refused:
        assert set(record) == {"id", "error"}
        assert "(--max-num-seqs=1 + --max-waiting-requests=0)" in record["error"]
    assert "1 of 3 requests done" in capsys.readouterr().err
    assert cli.main(["generate", str(llama), *flags, "--max-waiting-requests", "2", "--output", str(out)]) == 0
    done = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["id"], r["completion_tokens"]) for r in done] == [("q0", 4), ("q1", 4), ("q2", 4)]


# ----------------------------------------------------------------- embed(): tokenized a few texts at a time
_BERT_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(59)]


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory) -> str:
    """A random 2-layer BERT with its WordPiece tokenizer, saved as a sentence encoder's directory."""
    path = tmp_path_factory.mktemp("tiny-bert")
    save_tiny_bert(path, _BERT_VOCAB)
    return str(path)


async def test_embedding_many_texts_never_holds_the_event_loop_for_their_tokenizing(tiny_bert) -> None:
    """``embed()`` of many texts tokenized them all in one tokenizer call (in a worker thread): the fast tokenizer
    makes its results Python objects holding the GIL, in one call no other thread can interrupt, so the caller's
    event loop (every other caller) stalled for the whole batch: 0.26 s for 10,000 texts of MiniLM's tokenizer.
    The texts are tokenized :data:`~asyncinfer.models.encoder.TOKENIZE_CHUNK` (64) at a time now, the loop served
    between two calls; the vectors are those of one text at a time."""
    from asyncinfer.models.encoder import TOKENIZE_CHUNK

    assert TOKENIZE_CHUNK == 64
    texts = [" ".join(f"w{(7 * i + j) % 59}" for j in range(i % 5 + 1)) for i in range(30000)]
    options = {"num_threads": 1, "max_batch_size": 1024, "max_batch_tokens": 1 << 16, "max_wait_ms": 0}
    async with await AsyncEngine.load(tiny_bert, **options) as engine:
        alone = await engine.embed(texts[:3])
        async with loop_lags(0.002) as lags:
            await asyncio.sleep(0.02)
            vectors = await engine.embed(texts)
        assert vectors.shape == (30000, 32)
        torch.testing.assert_close(vectors[:3], alone, atol=1e-5, rtol=1e-5)
        assert engine.embedding_stats().num_texts == 30003
    assert max(lags) < 0.15, f"the loop stalled {max(lags) * 1e3:.0f} ms"  # before: 0.48 s, the whole tokenizing


# ----------------------------------------------------------------- a model config's sizes are bounded
_HF_KEYS = ["hidden_size", "intermediate_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window"]


@pytest.mark.parametrize("key", _HF_KEYS)
def test_a_config_json_size_past_max_config_size_is_refused_naming_its_key_before_any_weight(
        llama, tmp_path, monkeypatch, key) -> None:
    """A config.json's sizes were taken whatever their size: ``hidden_size``, ``vocab_size``, ``head_dim``,
    ``max_position_embeddings`` or ``sliding_window`` of 2**40 made a config that overflowed later (shapes, int32
    indices, byte counts), and a head count failed inside transformers' own validator. Each is held to
    ``MAX_CONFIG_SIZE`` (2**31 - 1) now: a ModelLoadError naming the key and the file, as the config is read,
    before any weight."""
    import json
    import shutil

    from asyncinfer import ModelLoadError
    from asyncinfer.models import loader
    from asyncinfer.models.config import MAX_CONFIG_SIZE

    assert MAX_CONFIG_SIZE == 2**31 - 1
    model = tmp_path / "model"
    shutil.copytree(llama, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, key: MAX_CONFIG_SIZE + 1}))

    def no_weights(*args, **kwargs):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(loader, "_materialise", no_weights)
    for read in (lambda: loader.read_model_config(model), lambda: AsyncEngine.from_pretrained(model, **BASE)):
        with pytest.raises(ModelLoadError) as info:
            read()
        assert f"config.json: {key} = {MAX_CONFIG_SIZE + 1}" in str(info.value)
        if key == "num_hidden_layers":  # the layers the shards hold bound it more tightly (test_fresh_pass7.py)
            assert "but its weights hold 2 layer(s)" in str(info.value)
        else:
            assert f"is larger than any model's (at most MAX_CONFIG_SIZE = {MAX_CONFIG_SIZE})" in str(info.value)


def test_sizes_at_max_config_size_are_read_and_the_model_config_holds_the_bound_itself(llama, tmp_path) -> None:
    """The bound itself is a size a config may give; past it, the ``ModelConfig`` every format is read into
    refuses it too (an embedding model's ``EncoderConfig`` alike), naming the field."""
    import dataclasses
    import json
    import shutil

    from asyncinfer import ModelLoadError
    from asyncinfer.models.config import MAX_CONFIG_SIZE
    from asyncinfer.models.encoder import EncoderConfig
    from asyncinfer.models.loader import read_model_config

    model = tmp_path / "model"
    shutil.copytree(llama, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": MAX_CONFIG_SIZE}))
    read = read_model_config(model)
    assert read.max_position_embeddings == MAX_CONFIG_SIZE
    for field in ("hidden_size", "vocab_size", "num_layers", "head_dim", "max_position_embeddings",
                  "sliding_window"):
        with pytest.raises(ModelLoadError, match=f"model config: {field} = {2**40} is larger than any model's"):
            dataclasses.replace(read, **{field: 2**40})
    with pytest.raises(ModelLoadError, match=f"encoder config: hidden_size = {2**40} is larger"):
        EncoderConfig(architecture="bert", vocab_size=30, hidden_size=2**40, intermediate_size=64, num_layers=2,
                      num_heads=4, max_position_embeddings=64, type_vocab_size=2, layer_norm_eps=1e-12,
                      hidden_act="gelu")


def test_an_encoder_config_json_size_past_max_config_size_is_refused_naming_its_key(tiny_bert, tmp_path) -> None:
    """An embedding model's config.json is held to the same bound, as it is read."""
    import json
    import shutil

    from asyncinfer import ModelLoadError
    from asyncinfer.models.encoder import read_encoder_config

    model = tmp_path / "encoder"
    shutil.copytree(tiny_bert, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2**63}))
    with pytest.raises(ModelLoadError, match=f"config.json: max_position_embeddings = {2**63} is larger"):
        read_encoder_config(model)
    with pytest.raises(ModelLoadError, match="max_position_embeddings"):
        asyncio.run(AsyncEngine.load(model, num_threads=1))


@pytest.mark.parametrize("key", ["context_length", "embedding_length", "feed_forward_length", "vocab_size",
                                 "attention.head_count", "attention.key_length", "attention.sliding_window"])
def test_a_gguf_header_size_past_max_config_size_is_refused_naming_its_key(tmp_path, key) -> None:
    """A GGUF header's sizes (``<arch>.context_length`` of 2**40, ...) are held to ``MAX_CONFIG_SIZE`` as the header
    is read, naming the metadata key, before its tensors or the other keys are looked at."""
    import gguf

    from asyncinfer import ModelLoadError
    from asyncinfer.models.loader import read_model_config

    kind = gguf.GGUFValueType
    keys = {"embedding_length": 64, "attention.head_count": 4, "feed_forward_length": 128, "context_length": 128,
            "block_count": 0, "vocab_size": 32, key: 2**40}
    path = tmp_path / "big.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, value in keys.items():
        writer.add_key_value(f"llama.{name}", value, kind.UINT64)
    writer.add_key_value("llama.attention.layer_norm_rms_epsilon", 1e-5, kind.FLOAT32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=rf"metadata llama\.{key} = {2**40} is larger than any model's"):
        read_model_config(path)
