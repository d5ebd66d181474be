"""Adversarial pass 13 (issue 25), in-process: the files of an embedding model.

An embedding model's directory is read as sentence-transformers writes it (config.json, modules.json,
1_Pooling/config.json, sentence_bert_config.json). A module's ``path`` in modules.json was followed wherever it
led (``..``, an absolute path: a file outside the directory opened and read, its pooling taken), a file of
another shape or a value of another type came out of ``plan_memory``, ``load`` and ``add_model`` as a bare
``AttributeError``, ``TypeError``, ``ValueError`` or ``OverflowError``, and a negative ``layer_norm_eps`` loaded
and made every embedding NaN.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncinfer import AsyncEngine, ModelLoadError, SamplingParams
from asyncinfer.models import encoder as encoder_module
from asyncinfer.models.encoder import EncoderConfig, read_encoder_config
from tests.helpers import llama_header_gguf, save_tiny_bert

_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world", "a", "b", "the"]
_OPTIONS = {"num_threads": 1, "max_wait_ms": 0}


@pytest.fixture(scope="module")
def tiny_st(tmp_path_factory) -> Path:
    """A random 2-layer BERT saved as sentence-transformers saves a model: modules.json, mean pooling in
    1_Pooling, a Normalize module, sentence_bert_config.json."""
    path = tmp_path_factory.mktemp("tiny-st")
    save_tiny_bert(path, _VOCAB)
    (path / "modules.json").write_text(json.dumps(_modules("1_Pooling")))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(_pooling("mean")))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 32}))
    return path


def _modules(pooling_path: Any) -> list[dict[str, Any]]:
    return [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": pooling_path, "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]


def _pooling(mode: str) -> dict[str, Any]:
    keys = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens"}
    return {"word_embedding_dimension": 32, **{key: m == mode for m, key in keys.items()}}


def _variant(tiny_st: Path, where: Path, files: dict[str, Any]) -> Path:
    """A copy of ``tiny_st`` with ``files`` (a name inside it -> JSON value, or raw text) written over."""
    shutil.copytree(tiny_st, where)
    for name, value in files.items():
        (where / name).write_text(value if isinstance(value, str) else json.dumps(value))
    return where


def test_the_tiny_model_reads_as_sentence_transformers_wrote_it(tiny_st) -> None:
    config = read_encoder_config(tiny_st)
    assert (config.pooling, config.normalize, config.max_seq_len, config.layer_norm_eps) == ("mean", True, 32, 1e-12)


@pytest.mark.parametrize("pooling_path", ["../outside", "{outside}", "1_Pooling/../../outside", "\x00"])
def test_a_pooling_module_path_outside_the_directory_is_refused_and_nothing_there_is_read(
        tiny_st, tmp_path, monkeypatch, pooling_path) -> None:
    """modules.json's Pooling ``path`` was joined to the directory as it was: ``../outside`` or an absolute path
    opened and read that directory's config.json (its CLS pooling was taken). Refused now by the name alone,
    naming modules.json and the path, before any file outside the directory is read; at every entry."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text(json.dumps(_pooling("cls")))
    pooling_path = pooling_path.format(outside=outside)
    model = _variant(tiny_st, tmp_path / "model", {"modules.json": _modules(pooling_path)})
    read: list[Path] = []
    real_read_json = encoder_module.read_json

    def spy(file: Path) -> Any:
        read.append(Path(file))
        return real_read_json(file)

    monkeypatch.setattr(encoder_module, "read_json", spy)
    with pytest.raises(ModelLoadError, match=r"modules\.json: the Pooling module's path .* is not a path inside"):
        read_encoder_config(model)
    with pytest.raises(ModelLoadError, match="the Pooling module's path"):
        AsyncEngine.plan_memory(model, available_bytes=1 << 30, **_OPTIONS)
    with pytest.raises(ModelLoadError, match="the Pooling module's path"):
        asyncio.run(AsyncEngine.load(model, **_OPTIONS))
    assert read and all(file.resolve().is_relative_to(model.resolve()) for file in read), read


def test_a_pooling_module_path_inside_the_directory_is_still_followed(tiny_st, tmp_path) -> None:
    model = _variant(tiny_st, tmp_path / "model", {"modules.json": _modules("pool/./cls")})
    (model / "pool" / "cls").mkdir(parents=True)
    (model / "pool" / "cls" / "config.json").write_text(json.dumps(_pooling("cls")))
    assert read_encoder_config(model).pooling == "cls"


_MALFORMED = [
    ("modules.json", {"type": "x"}, "modules.json: a JSON list of modules"),
    ("modules.json", "null", "modules.json: a JSON list of modules"),
    ("modules.json", ["1_Pooling"], "modules.json: a JSON list of modules"),
    ("modules.json", [{"type": 5}], "modules.json: a JSON list of modules"),
    ("modules.json", _modules(5), "the Pooling module's path 5 is not a path inside"),
    ("1_Pooling/config.json", [1], r"1_Pooling/config\.json: a JSON object was expected, not a list"),
    ("sentence_bert_config.json", [1], r"sentence_bert_config\.json: a JSON object was expected"),
    ("sentence_bert_config.json", {"max_seq_length": "abc"}, "max_seq_length = 'abc' must be an integer"),
    ("sentence_bert_config.json", '{"max_seq_length": 1e400}', "max_seq_length = inf must be an integer"),
    ("sentence_bert_config.json", {"max_seq_length": [32]}, r"max_seq_length = \[32\] must be an integer"),
    ("config.json", "[1]", None),
    ("config.json", {"model_type": "bert", "layer_norm_eps": "abc"}, "layer_norm_eps = 'abc' must be a positive"),
    ("config.json", {"model_type": "bert", "max_position_embeddings": "x"},
     "max_position_embeddings = 'x' must be an integer"),
    ("config.json", {"model_type": "bert", "max_position_embeddings": 63.5},
     "max_position_embeddings = 63.5 must be an integer"),
    ("config.json", {"model_type": "bert", "vocab_size": [10]}, r"vocab_size = \[10\] must be an integer"),
    ("config.json", {"model_type": "bert", "hidden_size": None}, "config.json lacks 'hidden_size'"),
]


@pytest.mark.parametrize(("name", "value", "message"), _MALFORMED,
                         ids=[f"{name}-{str(value)[:24]}" for name, value, _ in _MALFORMED])
def test_a_sentence_transformers_file_of_another_shape_is_a_model_load_error_naming_it(
        tiny_st, tmp_path, name, value, message) -> None:
    """A file of another shape (a list for an object, ``null`` for modules) or a value of another type (text
    for a number, a fraction for a size) was a bare AttributeError, TypeError, ValueError or OverflowError out
    of ``plan_memory``, ``load`` and ``add_model``; a ModelLoadError naming the file and the key now."""
    if name == "config.json" and isinstance(value, dict):
        value = {**json.loads((tiny_st / "config.json").read_text()), **value}
        value = {k: v for k, v in value.items() if v is not None}
    model = _variant(tiny_st, tmp_path / "model", {name: value})
    options: dict[str, Any] = _OPTIONS
    if message is None:  # config.json no object: not an encoder, so read as a generator's, refused as one
        message, options = r"config\.json: expected a JSON object, got list", {"num_threads": 1}
    else:
        with pytest.raises(ModelLoadError, match=message):
            read_encoder_config(model)
    with pytest.raises(ModelLoadError, match=message):
        AsyncEngine.plan_memory(model, available_bytes=1 << 30, **options)
    with pytest.raises(ModelLoadError, match=message):
        asyncio.run(AsyncEngine.load(model, **options))


async def test_add_model_names_the_file_of_another_shape_and_the_engine_serves_on(
        tiny_st, tiny_models, tmp_path) -> None:
    model = _variant(tiny_st, tmp_path / "model", {"sentence_bert_config.json": {"max_seq_length": "abc"}})
    good = _variant(tiny_st, tmp_path / "good", {})
    path, _ = tiny_models["llama"]
    async with await AsyncEngine.load(path, dtype="float32", device="cpu", kv_cache_memory=4 << 20,
                                      max_model_len=64, num_threads=1) as engine:
        with pytest.raises(ModelLoadError, match="max_seq_length = 'abc' must be an integer"):
            await engine.add_model("bad", model, **_OPTIONS)
        await engine.add_model("good", good, **_OPTIONS)
        assert (await engine.embed("hello world", model="good")).shape == (1, 32)


@pytest.mark.parametrize("eps", [-1.0, 0, float("inf"), 1e-50])
def test_a_layer_norm_eps_that_is_not_positive_in_float32_is_refused_by_name(tiny_st, tmp_path, eps) -> None:
    """A negative ``layer_norm_eps`` loaded, and every embedding the model made was NaN (over HTTP too); it is held
    to what the generators' ``rms_norm_eps`` is held to: a positive number float32 holds."""
    config = json.loads((tiny_st / "config.json").read_text())
    model = _variant(tiny_st, tmp_path / "model", {"config.json": json.dumps({**config, "layer_norm_eps": eps})})
    with pytest.raises(ModelLoadError, match="config.json: layer_norm_eps = .* must be a positive number that float32"):
        asyncio.run(AsyncEngine.load(model, **_OPTIONS))
    with pytest.raises(ModelLoadError, match="encoder config: layer_norm_eps=-1.0 must be a positive number"):
        EncoderConfig(architecture="bert", vocab_size=10, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, max_position_embeddings=64, type_vocab_size=2, layer_norm_eps=-1.0,
                      hidden_act="gelu")


async def test_an_embedding_model_with_its_own_eps_embeds_finite_unit_vectors(tiny_st, tmp_path) -> None:
    config = json.loads((tiny_st / "config.json").read_text())
    model = _variant(tiny_st, tmp_path / "model", {"config.json": json.dumps({**config, "layer_norm_eps": 1e-5})})
    async with await AsyncEngine.load(model, **_OPTIONS) as engine:
        vectors = await engine.embed(["hello world", "a b the"])
    assert torch.isfinite(vectors).all() and torch.allclose(vectors.norm(dim=1), torch.ones(2), atol=1e-5)


# ---- a generator's rope scaling ----------------------------------------------------------------------------

_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 64}
_BAD_ROPE = [
    ({"rope_type": "linear", "factor": 0.0}, "linear rope: factor must be a finite number > 0, got 0.0"),
    ({"rope_type": "linear", "factor": -2.0}, "linear rope: factor must be a finite number > 0, got -2.0"),
    ({"rope_type": "linear", "factor": "2"}, "linear rope: factor must be a finite number > 0, got '2'"),
    ({**_LLAMA3, "factor": -8.0}, "llama3 rope: factor must be a finite number > 0, got -8.0"),
    ({**_LLAMA3, "low_freq_factor": 0.0}, "llama3 rope: low_freq_factor must be a finite number > 0, got 0.0"),
    ({**_LLAMA3, "original_max_position_embeddings": 0},
     "llama3 rope: original_max_position_embeddings must be a finite number > 0, got 0"),
]


@pytest.mark.parametrize(("scaling", "message"), _BAD_ROPE, ids=[m.split(",")[0] for _, m in _BAD_ROPE])
def test_a_rope_scaling_divisor_that_is_not_a_positive_number_is_refused_by_name(
        tiny_models, tmp_path, scaling, message) -> None:
    """A config.json whose linear rope ``factor`` was 0 loaded, and the model's logits were NaN from its second
    position on (its reply a run of token 0 with NaN log-probabilities); a negative or text factor loaded too
    (transformers only warns), and llama3's ``low_freq_factor`` of 0 was a bare 'float division by zero'. Each
    divisor of the rope frequencies is held to a finite number > 0, as yarn's and longrope's already were."""
    src, _ = tiny_models["llama"]
    model = tmp_path / "model"
    shutil.copytree(src, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "rope_scaling": scaling}))
    with pytest.raises(ModelLoadError, match=message):
        asyncio.run(AsyncEngine.load(model, dtype="float32", device="cpu", kv_cache_memory=4 << 20,
                                     max_model_len=128, num_threads=1))


def test_rope_scalings_with_positive_divisors_still_load(tiny_models, tmp_path) -> None:
    from asyncinfer.memory import read_model_config

    src, _ = tiny_models["llama"]
    for i, scaling in enumerate(({"rope_type": "linear", "factor": 2}, _LLAMA3)):
        model = tmp_path / f"model{i}"
        shutil.copytree(src, model)
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "rope_scaling": scaling}))
        assert read_model_config(model).rope_scaling["rope_type"] == scaling["rope_type"]


@pytest.mark.parametrize(("factors", "linear", "message"), [
    ([0.0] * 8, None, r"rope freq_factors\[0\] must be a finite number > 0, got 0.0"),
    ([1.0] * 7 + [float("nan")], None, r"rope freq_factors\[7\] must be a finite number > 0, got nan"),
    ([1.0] * 3 + [-1.0] * 5, None, r"rope freq_factors\[3\] must be a finite number > 0, got -1.0"),
    (None, 0.0, "linear rope: factor must be a finite number > 0, got 0.0"),
])
def test_a_gguf_rope_divisor_that_is_not_a_positive_number_is_refused_by_name(tmp_path, factors, linear,
                                                                             message) -> None:
    """A GGUF file's ``rope_freqs.weight`` (Llama 3.1's per-frequency divisors) of zeros, NaN or negatives, or a
    ``rope.scaling.factor`` of 0, was taken as it was (every logit NaN); refused as the header is read."""
    import gguf
    import numpy as np

    from asyncinfer.memory import read_model_config

    path = tmp_path / "rope.gguf"
    writer = llama_header_gguf(path, block_count=1)
    kind = gguf.GGUFValueType
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))  # the one layer block_count says
    if linear is not None:
        writer.add_key_value("llama.rope.scaling.type", "linear", kind.STRING)
        writer.add_key_value("llama.rope.scaling.factor", linear, kind.FLOAT32)
    if factors is not None:
        writer.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=message):
        read_model_config(path)


# ---- trim_messages ------------------------------------------------------------------------------------------


class _EndlessHistory(Sequence[dict[str, str]]):
    """A sequence whose ``__len__`` says 1 and whose ``__getitem__`` never raises IndexError (so it never ends);
    it stops the test (RuntimeError) once read far past any limit, where the process would run out of memory."""

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i):  # type: ignore[override]
        if i > 200_000:
            raise RuntimeError("read 200,000 items of an endless sequence")
        return {"role": "user", "content": "hi"}


def test_trim_messages_reads_an_endless_history_a_bounded_way_and_refuses_it_by_name(monkeypatch) -> None:
    """``trim_messages`` checked its messages with ``all(... for m in messages)`` and then ``list(messages)``: a
    sequence that never ends was read for ever (until memory ran out), as the engine's prompts once were. It is
    read as they are now (``prompts.plain_list``: at most MAX_SEQUENCE_ITEMS items), then refused naming
    ``messages``; a list subclass is read for the dicts it holds, and a budget as the int it holds."""
    from asyncinfer import InvalidParameterError, prompts, trim_messages
    from tests.helpers import Posing

    monkeypatch.setattr(prompts, "MAX_SEQUENCE_ITEMS", 1000)
    with pytest.raises(InvalidParameterError) as refused:
        trim_messages(_EndlessHistory(), 100, len)
    assert refused.value.parameter == "messages" and "more than 1000 items" in str(refused.value)

    class Lying(list):  # iterates as no messages at all, holds two
        def __iter__(self):
            return iter(())

    history = Lying([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    assert trim_messages(history, 100, len) == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    with pytest.raises(InvalidParameterError, match="budget=-1"):
        trim_messages([{"role": "user", "content": "a"}], Posing(-1, 50), len)
    with pytest.raises(InvalidParameterError, match="messages"):
        trim_messages({"role": "user", "content": "a"}, 100, len)


# ---- model names ----------------------------------------------------------------------------------------------


async def test_a_model_name_with_a_lone_surrogate_is_refused_by_name_at_every_entry(tiny_models) -> None:
    """A model's name is in every metric series' labels, the /v1/models answer and the log lines, each written as
    UTF-8: ``add_model("a\\ud800b", ...)`` was taken, and from then on every /metrics scrape of the engine (every
    model's figures) failed with a UnicodeEncodeError. Refused now as prompts with one are, naming ``name``;
    the engine serves on, and its metrics are read."""
    from asyncinfer import InvalidParameterError
    from asyncinfer.metrics.exposition import exposition
    from asyncinfer.server import ModelSpec, create_app

    path, _ = tiny_models["qwen2"]
    options = {"kv_cache_memory": 4 << 20, "max_model_len": 64, "dtype": "float32", "device": "cpu", "num_threads": 1}
    bad = "team\ud800model"
    with pytest.raises(InvalidParameterError, match="lone surrogate") as refused:
        await AsyncEngine.load(path, name=bad, **options)
    assert refused.value.parameter == "name"
    with pytest.raises(InvalidParameterError, match="lone surrogate") as refused:
        create_app(ModelSpec(str(path), bad, options))
    assert refused.value.parameter == "models[0].name"
    async with await AsyncEngine.load(path, name="ok", **options) as engine:
        with pytest.raises(InvalidParameterError, match="lone surrogate") as refused:
            await engine.add_model(bad, path, **options)
        assert refused.value.parameter == "name" and [i.name for i in engine.model_info()] == ["ok"]
        await engine.add_model('odd "name"\nwith a line break', path, **options)  # valid text: served and scraped
        await engine.generate([1, 2], SamplingParams(max_tokens=2), model='odd "name"\nwith a line break')
        assert b'model="odd \\"name\\"\\nwith a line break"' in exposition(engine)


# ---- model files that are no regular files -----------------------------------------------------------------


def _linked_copy(src: Path, where: Path) -> Path:
    where.mkdir()
    for item in src.iterdir():
        (where / item.name).symlink_to(item)
    return where


def _refusal_of(call: Any, pipe: Path) -> BaseException:
    """What ``call()`` raises, run in a thread for at most 20 s; one still blocked on ``pipe`` then (opened for
    reading, waiting for a writer) is let go (the pipe opened for writing, then closed: it reads its end), and the
    test fails."""
    import os
    import threading

    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(20)
    if thread.is_alive():
        with contextlib.suppress(OSError):
            os.close(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(20)
        pytest.fail(f"the load waited on the pipe {pipe.name} (it was opened and read)")
    assert raised, "the load took the pipe"
    return raised[0]


@pytest.mark.parametrize("name", ["tokenizer_config.json", "config.json", "generation_config.json"])
def test_a_model_file_that_is_a_pipe_is_refused_before_it_is_opened(tiny_models, tmp_path, name) -> None:
    """A model directory's file that is a named pipe (or leads to a device: /dev/zero was read until the machine's
    memory ran out) was opened and read: the load waited for a writer for ever. Every metadata file the loaders
    or transformers read is checked with ``stat`` first (a regular file, of a bounded size), refused by name."""
    import os

    src, _ = tiny_models["llama"]
    model = _linked_copy(src, tmp_path / "model")
    (model / "tokenizer_config.json").write_text("{}")  # a tokenizer file, so that the tokenizer is loaded
    (model / "tokenizer.json").write_text("{}")
    if (model / name).exists() or (model / name).is_symlink():
        (model / name).unlink()
    os.mkfifo(model / name)
    refusal = _refusal_of(lambda: asyncio.run(AsyncEngine.load(model, dtype="float32", device="cpu", num_threads=1)),
                          model / name)
    assert isinstance(refusal, ModelLoadError) and f"{name}: it is not a regular file" in str(refusal), refusal


def test_an_embedding_models_file_that_is_a_pipe_or_a_directory_is_refused(tiny_st, tmp_path) -> None:
    import os

    model = _variant(tiny_st, tmp_path / "model", {})
    (model / "modules.json").unlink()
    os.mkfifo(model / "modules.json")
    refusal = _refusal_of(lambda: read_encoder_config(model), model / "modules.json")
    assert isinstance(refusal, ModelLoadError) and "modules.json: it is not a regular file" in str(refusal), refusal
    other = _variant(tiny_st, tmp_path / "other", {})
    (other / "sentence_bert_config.json").unlink()
    (other / "sentence_bert_config.json").mkdir()
    with pytest.raises(ModelLoadError, match=r"sentence_bert_config\.json: it is not a regular file"):
        read_encoder_config(other)


def test_a_json_metadata_file_past_its_size_is_refused_unread(tiny_models, tmp_path) -> None:
    """config.json of more than ``MAX_JSON_BYTES`` (64 MiB; a sparse file here, so nothing is written) is refused
    by its size before it is read: it was read and parsed whole, however large."""
    from asyncinfer.memory import read_model_config
    from asyncinfer.models.checkpoint import MAX_JSON_BYTES

    src, _ = tiny_models["llama"]
    model = _linked_copy(src, tmp_path / "model")
    (model / "config.json").unlink()
    with open(model / "config.json", "wb") as f:
        f.truncate(MAX_JSON_BYTES + 1)
    with pytest.raises(ModelLoadError, match=f"config.json: it holds {MAX_JSON_BYTES + 1} bytes, more than"):
        read_model_config(model)


@pytest.mark.parametrize(("kind", "freqs", "said"), [("yarn", False, "'yarn'"),
                                                    ("linear", True, "'linear' with a rope_freqs.weight tensor")])
def test_an_unsupported_gguf_rope_scaling_names_the_types_a_gguf_may_have(tmp_path, kind, freqs, said) -> None:
    """stranger68: ``unsupported GGUF rope scaling 'yarn'`` named none of the types the docs say it names."""
    import gguf
    import numpy as np

    from asyncinfer.memory import read_model_config

    path = tmp_path / "rope.gguf"
    writer = llama_header_gguf(path, block_count=1)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))
    writer.add_key_value("llama.rope.scaling.type", kind, gguf.GGUFValueType.STRING)
    writer.add_key_value("llama.rope.scaling.factor", 2.0, gguf.GGUFValueType.FLOAT32)
    if freqs:
        writer.add_tensor("rope_freqs.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError) as refused:
        read_model_config(path)
    assert str(refused.value) == (f"unsupported GGUF rope scaling {said}: a GGUF's llama.rope.scaling.type may be none, "
                                  "linear (without rope_freqs.weight), or longrope (Phi-3's factor tensors); Llama "
                                  "3.1's scaling is its rope_freqs.weight tensor with no type")
