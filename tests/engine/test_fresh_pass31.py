"""pass31: a final adversarial pass in-process, on a model directory's files.

A ``tokenizer.json`` whose normalizer writes more than it reads (``Replace`` steps in a ``Sequence``, each writing
1,000 ``a`` for every ``a``) loaded, and the first chat request (its template writes ``assistant``) made the tokenizers
library ask for 4 GiB and the process aborted: one request took the engine and every neighbour down (and a text of
``OFF_LOOP_CHARS`` characters, tokenized on the event loop, became a million times that). A normalizer or decoder that
can multiply a text by more than ``MAX_TEXT_GROWTH`` is now a ModelLoadError naming the file, before the library reads
it; real tokenizers (Llama's ``Prepend`` and ``Replace``, T5's regular expression) load as before.

A ``tokenizer_config.json`` whose ``model_max_length`` is not a number (``"x"``) loaded, and every text or chat request
then raised transformers' bare ``TypeError`` from ``generate()`` (it compares each encoded text's length with it); it is
a ModelLoadError naming the key now.

A ``model.safetensors`` whose header is JSON nested deeper than Python's reader goes (or a JSON list) made
``plan_memory`` raise a bare ``RecursionError`` (``AttributeError``), from the look for a truncated file that follows
the library's refusal; the library's own refusal, a ModelLoadError, stands now.

A ``model`` argument that names no path was refused by ``plan_memory`` as an InvalidParameterError on ``model``,
but ``from_pretrained``/``load`` formatted it first (an object whose ``__str__`` raises: that error, bare), and an
``os.PathLike`` whose ``__fspath__`` returns a number or raises came out of every call (``add_model`` and
``swap_model`` too) as a bare ``TypeError`` or the object's own error. Each is the InvalidParameterError now.

``engine.apply_chat_template(None)`` (or a number, an object, a generator) iterated what it was given: a bare
``TypeError`` (or the generator's own error), where ``generate()`` and the docs' "a list of chat messages" name
``prompt``. It is the InvalidParameterError on ``prompt`` now.

``engine.aclose(abort=...)`` handed its ``abort`` to the engine thread as it came: an object whose ``__bool__`` raises
ended the step loop there (the engine dead, every request in flight failing with EngineDeadError), and ``"yes"`` or
``1`` were taken for True, where ``swap_model`` and ``remove_model`` refuse an ``abort`` that is no bool. It is an
InvalidParameterError on ``abort`` now, before anything changes.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import struct

import pytest

from asyncinfer import AsyncEngine, SamplingParams
from asyncinfer.errors import AsyncInferError, InvalidParameterError, ModelLoadError
from asyncinfer.models.checkpoint import MAX_TEXT_GROWTH, load_hf_tokenizer

OPTIONS = {"max_model_len": 128, "dtype": "float32", "device": "cpu", "num_threads": 1,
           "kv_cache_memory": 1024 * 1024}


@pytest.fixture()
def chat_dir(tiny_models, tmp_path):
    """The suite's tiny Llama with a small word-level tokenizer (ids below its vocabulary) and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path / "model"
    shutil.copytree(tiny_models["llama"][0], path)
    words = ["<unk>", "<s>", "</s>", "a", "hi", "user", "assistant", "hello", "world", "▁", "▁a"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}assistant"
    fast.save_pretrained(path)
    return path


def _set_normalizer(path, normalizer, part="normalizer"):
    data = json.loads((path / "tokenizer.json").read_text())
    data[part] = normalizer
    (path / "tokenizer.json").write_text(json.dumps(data))


def _replace(pattern, content, kind="String"):
    return {"type": "Replace", "pattern": {kind: pattern}, "content": content}


@pytest.mark.parametrize("normalizer", [
    {"type": "Sequence", "normalizers": [_replace("a", "a" * 1000)] * 3},
    _replace("a", "a" * (MAX_TEXT_GROWTH + 1)),
    _replace(".", "b" * MAX_TEXT_GROWTH, kind="Regex"),
    {"type": "Sequence", "normalizers": [{"type": "Sequence", "normalizers": [_replace("a", "aaaa")] * 2}] * 2},
    {"type": "Prepend", "prepend": "x" * MAX_TEXT_GROWTH},
])
def test_a_normalizer_that_multiplies_a_text_is_refused_before_the_library_reads_it(chat_dir, normalizer) -> None:
    _set_normalizer(chat_dir, normalizer)
    with pytest.raises(ModelLoadError, match=f"tokenizer.json's normalizer can multiply a text's characters by more "
                                             f"than {MAX_TEXT_GROWTH}"):
        load_hf_tokenizer(chat_dir)
    with pytest.raises(ModelLoadError, match="tokenizer.json's normalizer"):
        AsyncEngine.from_pretrained(str(chat_dir), **OPTIONS)


def test_a_decoder_that_multiplies_a_text_is_refused(chat_dir) -> None:
    _set_normalizer(chat_dir, {"type": "Sequence", "decoders": [_replace("a", "a" * 1000)] * 3}, part="decoder")
    with pytest.raises(ModelLoadError, match="tokenizer.json's decoder can multiply"):
        load_hf_tokenizer(chat_dir)


@pytest.mark.parametrize("normalizer", [
    {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"}, _replace(" ", "▁")]},  # Llama 2's
    {"type": "Sequence", "normalizers": [{"type": "NFKC"}, _replace(" {2,}", " ", kind="Regex")]},  # T5's kind
    _replace("aaaa", "a" * (4 * MAX_TEXT_GROWTH)),
])
def test_real_normalizers_load_and_serve(chat_dir, normalizer) -> None:
    _set_normalizer(chat_dir, normalizer)
    assert load_hf_tokenizer(chat_dir) is not None

    async def chat():
        async with await AsyncEngine.load(str(chat_dir), **OPTIONS) as engine:
            out = await engine.generate([{"role": "user", "content": "a hi"}], SamplingParams(max_tokens=8))
            return out.outputs[0].finish_reason, engine.kv_stats().used_blocks

    assert asyncio.run(chat()) == ("length", 0)


@pytest.mark.parametrize("value", ["x", [512], {"n": 1}])
def test_a_model_max_length_that_is_no_number_is_a_model_load_error(chat_dir, value) -> None:
    config = json.loads((chat_dir / "tokenizer_config.json").read_text())
    config["model_max_length"] = value
    (chat_dir / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="its model_max_length is .*, not a number"):
        load_hf_tokenizer(chat_dir)

    async def load_and_chat():
        async with await AsyncEngine.load(str(chat_dir), **OPTIONS) as engine:
            await engine.generate([{"role": "user", "content": "hi"}])

    with pytest.raises(ModelLoadError, match="model_max_length"):
        asyncio.run(load_and_chat())


@pytest.mark.parametrize("header", [b"[" * 100_000 + b"]" * 100_000, b"[1, 2]", b'"text"'])
def test_a_safetensors_header_that_is_no_object_is_a_model_load_error(chat_dir, header) -> None:
    header += b" " * (-len(header) % 8)
    (chat_dir / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 64)
    try:
        AsyncEngine.plan_memory(str(chat_dir), **OPTIONS)  # planned from config.json alone, or refused by name
    except AsyncInferError as exc:
        assert isinstance(exc, ModelLoadError) and "model.safetensors" in str(exc)
    with pytest.raises(ModelLoadError, match="cannot read weights from .*model.safetensors"):
        AsyncEngine.from_pretrained(str(chat_dir), **OPTIONS)


class _RaisingStr:
    """An object whose ``__str__`` (and ``repr``) raises."""

    def __str__(self) -> str:
        raise RuntimeError("str of a caller's object")

    __repr__ = __str__


class _PathOfNumber:
    """An ``os.PathLike`` whose ``__fspath__`` returns a number (Python's own ``TypeError`` from ``os.fspath``)."""

    def __fspath__(self):
        return 5


class _RaisingPath:
    def __fspath__(self):
        raise RuntimeError("fspath of a caller's object")


@pytest.mark.parametrize("model", [_RaisingStr(), _PathOfNumber(), _RaisingPath()], ids=lambda m: type(m).__name__)
def test_a_model_argument_that_names_no_path_is_refused_by_name_by_every_call(tiny_models, model) -> None:
    with pytest.raises(InvalidParameterError) as plan:
        AsyncEngine.plan_memory(model)
    with pytest.raises(InvalidParameterError) as load:
        AsyncEngine.from_pretrained(model, **OPTIONS)
    assert plan.value.parameter == load.value.parameter == "model"

    async def add_and_swap():
        async with await AsyncEngine.load(str(tiny_models["llama"][0]), **OPTIONS) as engine:
            for call in (engine.add_model("second", model, **OPTIONS), engine.swap_model(model, **OPTIONS)):
                with pytest.raises(InvalidParameterError) as refused:
                    await call
                assert refused.value.parameter == "model"
            return [info.name for info in engine.model_info()], engine.kv_stats().used_blocks

    assert asyncio.run(add_and_swap()) == (["default"], 0)


def _messages_then_raise():
    yield {"role": "user", "content": "hi"}
    raise RuntimeError("a generator of the caller's")


@pytest.mark.parametrize("messages", [None, 5, _RaisingStr(), _messages_then_raise(), {"role": "user"}.values()],
                         ids=["None", "int", "object", "generator", "dict_values"])
def test_apply_chat_template_refuses_what_is_no_list_of_messages_by_name(chat_dir, messages) -> None:
    async def render():
        async with await AsyncEngine.load(str(chat_dir), **OPTIONS) as engine:
            with pytest.raises(InvalidParameterError) as refused:
                engine.apply_chat_template(messages)
            assert refused.value.parameter == "prompt"
            return engine.apply_chat_template(({"role": "user", "content": "hi"},))  # a tuple is a list of messages

    assert asyncio.run(render())


def test_apply_chat_template_refuses_no_messages_as_generate_does(chat_dir) -> None:
    """``apply_chat_template([])`` reached the template and was refused showing the value 'chat messages'."""
    async def render():
        async with await AsyncEngine.load(str(chat_dir), **OPTIONS) as engine:
            for empty in ([], ()):
                with pytest.raises(InvalidParameterError) as refused:
                    engine.apply_chat_template(empty)
                assert (refused.value.parameter, refused.value.value) == ("prompt", [])
                assert refused.value.allowed == "a non-empty list of chat messages ({'role': ..., 'content': ...})"

    asyncio.run(render())


class _RaisingBool:
    def __bool__(self) -> bool:
        raise RuntimeError("bool of a caller's object")


@pytest.mark.parametrize("abort", [_RaisingBool(), "yes", 1, None], ids=["raising-bool", "str", "int", "None"])
def test_aclose_refuses_an_abort_that_is_no_bool_before_the_engine_thread_reads_it(chat_dir, abort) -> None:
    async def close():
        engine = await AsyncEngine.load(str(chat_dir), **OPTIONS)
        await engine.start()
        requests = [asyncio.create_task(engine.generate([5, 6], SamplingParams(max_tokens=40, ignore_eos=True)))
                    for _ in range(3)]
        await asyncio.sleep(0.05)
        with pytest.raises(InvalidParameterError) as refused:
            await engine.aclose(abort=abort)
        assert refused.value.parameter == "abort"
        done = await asyncio.gather(*requests)  # served on, to their end
        await engine.aclose()
        return [out.outputs[0].finish_reason for out in done], engine.state.name

    assert asyncio.run(close()) == (["length"] * 3, "CLOSED")
