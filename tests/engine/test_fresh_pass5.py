"""Adversarial pass 5: faults one caller could cause for others, found on the engine side and fixed."""

from __future__ import annotations

import pytest

from asyncinfer.detokenizer import IncrementalDetokenizer
from asyncinfer.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def smol(real_gguf):
    """The default model's own tokenizer (byte-level BPE)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_gguf.parent, gguf_file=real_gguf.name)


def _byte_ids(tokenizer) -> dict[int, int]:
    """Each byte's own token in a byte-level BPE vocabulary: byte -> id."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return {byte: tokenizer.convert_tokens_to_ids(char) for byte, char in chars.items()}


def _stream(tokenizer, ids, skip=True):
    """Feed ``ids``; the streamed text, and how many ids the decodes read in all."""
    det = IncrementalDetokenizer(tokenizer, [1], SamplingParams(max_tokens=len(ids) + 1, skip_special_tokens=skip))
    read = 0
    decode = det._decode

    def counting(window):
        nonlocal read
        read += len(window)
        return decode(window)

    det._decode = counting  # type: ignore[method-assign]
    text = "".join(det.add(t)[0] for t in ids) + det.flush()
    return text, read, det


@pytest.mark.parametrize("run", ["bytes that are no UTF-8", "special tokens the decode skips"])
def test_a_reply_of_tokens_that_give_no_text_costs_the_same_per_token_however_long(smol, run) -> None:
    """A caller made the default model write a run of tokens that decode to nothing or to U+FFFD only (a prompt
    of those token ids and ``repetition_penalty`` 0.01, over HTTP too). Each token decoded the whole run again:
    8,000 of them took 0.75 ms a token on the engine thread, in every step its neighbours shared (3.6 s in all;
    64 samples: 48 ms a step). Now a token costs a bounded decode, and the text is the whole decode's."""
    token = _byte_ids(smol)[0x80] if run.startswith("bytes") else smol.convert_tokens_to_ids("<|im_start|>")
    hello = smol.encode("hello wörld 世界")
    for ids in ([token] * 3000, hello + [token] * 3000 + hello):
        text, read, det = _stream(smol, ids)
        assert text == det.text == smol.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
        assert read < 40 * len(ids)  # before: 4.5 million ids read for 3,000 tokens


def test_a_character_split_by_a_long_run_of_skipped_tokens_is_still_whole(smol) -> None:
    """Settling a run keeps the text exact: a character's bytes with special tokens between them, invalid bytes
    before and after, kept or skipped, give the whole decode's text."""
    byte = _byte_ids(smol)
    special = smol.convert_tokens_to_ids("<|endoftext|>")
    euro = [byte[0xE2], byte[0x82], byte[0xAC]]
    hello = smol.encode("hello wörld 世界")
    cases = [
        euro[:1] + [special] * 40 + euro[1:],
        euro[:1] + [special] * 20 + euro[1:2] + [special] * 20 + euro[2:] + hello,
        [byte[0x82]] * 100 + euro + hello,
        [special] * 30 + euro[:2] + [byte[0x82]] * 50 + euro,
        hello + [byte[0xF0]] * 40,
    ]
    for ids in cases:
        for skip in (True, False):
            text, _read, det = _stream(smol, ids, skip)
            assert text == det.text == smol.decode(ids, skip_special_tokens=skip).rstrip("\ufffd")


async def test_a_long_prompt_tokenized_off_the_loop_leaves_the_loop_free(real_gguf) -> None:
    """The default model's tokenizer (a GGUF file's :class:`CachedTokenizer`) encoded with the library's ``encode``,
    which holds the GIL while it works: a prompt of 600,000 characters (under the characters the default
    ``max_model_len`` takes before tokenizing, 8192 x 81), tokenized in a worker thread so that the loop serves on,
    held the loop (and the engine thread) for the whole encode, 0.4 s; one caller sending such prompts froze
    everyone. It encodes as transformers' tokenizers do now, letting go of the GIL; the ids are the same."""
    import asyncio
    import time

    from asyncinfer.models.loader import gguf_tokenizer
    from asyncinfer.models.tokenizer import CachedTokenizer
    from tests.helpers import loop_lags

    tokenizer = gguf_tokenizer(real_gguf)
    assert isinstance(tokenizer, CachedTokenizer)
    text = "the cat sat on the mat, naïvely — 世界. " * 16000
    assert tokenizer.encode(text[:5000]) == tokenizer.backend_tokenizer.encode(text[:5000]).ids
    assert tokenizer(["a b", "c"])["input_ids"] == [tokenizer.encode("a b"), tokenizer.encode("c")]
    async with loop_lags(0.002) as lags:
        await asyncio.sleep(0.05)
        start = time.perf_counter()
        ids = await asyncio.to_thread(tokenizer.encode, text)
        took = time.perf_counter() - start
    assert len(ids) > 100_000
    assert max(lags) < max(0.5 * took, 0.05), (max(lags), took)  # before: the loop waited for all of it


def test_a_spec_built_from_values_that_are_no_json_is_refused_by_name() -> None:
    """``StructuredOutput.choice(["a", {}])`` raised a bare ``TypeError`` (unhashable type: 'dict') and
    ``json_schema`` of a mapping that is no dict (``MappingProxyType``) json's ``TypeError``: each is an
    ``InvalidParameterError`` on ``structured`` now, as every other bad spec is."""
    from types import MappingProxyType

    from asyncinfer.errors import InvalidParameterError
    from asyncinfer.structured import StructuredOutput

    for build in (lambda: StructuredOutput.choice(["a", {}]), lambda: StructuredOutput.choice([["a"], "b"]),
                  lambda: StructuredOutput.json_schema(MappingProxyType({"type": "string"})),
                  lambda: StructuredOutput.json_schema({"anyOf": [MappingProxyType({"type": "string"})]})):
        with pytest.raises(InvalidParameterError) as info:
            build()
        assert info.value.parameter == "structured"
    assert StructuredOutput.choice(("b", "a", "b")).value == ("b", "a")


class _RaisingName(str):
    """A model name whose ``__hash__`` and ``__eq__`` raise."""

    def __hash__(self) -> int:
        raise RuntimeError("hash")

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("eq")


async def test_a_model_name_whose_hash_raises_is_read_as_the_name_it_holds(tiny_models) -> None:
    """Every call naming a model looked the name up as it came: a ``str`` subclass whose ``__hash__`` raised came
    out of ``generate``, ``stream``, ``embed``, ``swap_model``, ``kv_stats``, ``get_tokenizer``, ``tokenize``,
    ``check_admission``... as a bare ``RuntimeError``. The name is read as the plain ``str`` it holds, as
    ``remove_model`` and ``add_model`` read it: the model it names answers, another is the typed refusal."""
    from asyncinfer import AsyncEngine
    from asyncinfer.errors import InvalidParameterError
    from tests.helpers import ENGINE_BASE, greedy

    async with AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE) as engine:
        named, other = _RaisingName("default"), _RaisingName("nope")
        expected = await engine.generate([3, 4, 5], greedy(3))
        assert (await engine.generate([3, 4, 5], greedy(3), model=named)).token_ids == expected.token_ids
        assert [d async for d in engine.stream([3, 4, 5], greedy(3), model=named)][-1].finish_reason == "length"
        assert engine.kv_stats(named) is not None and engine.step_stats(named) is not None
        assert engine.get_tokenizer(named) is engine.get_tokenizer()
        assert engine.tokenize([3, 4], model=named) == [3, 4]
        engine.check_admission(1, model=named)
        for call in (lambda: engine.kv_stats(other), lambda: engine.get_tokenizer(other),
                     lambda: engine.tokenize([3], model=other), lambda: engine.check_admission(1, model=other),
                     lambda: engine.embedding_stats(other)):
            with pytest.raises(InvalidParameterError) as info:
                call()
            assert info.value.parameter == "model"
        for call in (lambda: engine.generate([3], greedy(1), model=other), lambda: engine.embed("x", model=other),
                     lambda: engine.swap_model(tiny_models["llama"][0], name=other, **ENGINE_BASE)):
            with pytest.raises(InvalidParameterError) as info:
                await call()
            assert info.value.parameter in ("model", "name")
        assert (await engine.generate([3, 4, 5], greedy(3))).token_ids == expected.token_ids
