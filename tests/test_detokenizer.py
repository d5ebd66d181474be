from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncinfer.detokenizer import IncrementalDetokenizer
from asyncinfer.sampling_params import SamplingParams

_CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "héllo wörld ça va? naïve café",
    "世界你好，今天天气很好。",
    "emoji 😀🎉👍🏽 test",
    "def f(x):\n    return x * 2\n",
] * 20


def _bytelevel():
    """A tiny GPT-2-style byte-level BPE tokenizer, trained in memory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def _metaspace():
    """A tiny Llama/SentencePiece-style tokenizer: '▁' spaces, byte fallback, leading space stripped."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    norm = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = norm
    base.train_from_iterator(
        _CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    )
    model = json.loads(base.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = norm
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", bos_token="<s>", unk_token="<unk>")


_BUILDERS = {"bytelevel": _bytelevel, "metaspace": _metaspace}


class _Named(tuple):
    """(name, tokenizer) with a short repr, so failure reports stay readable."""

    def __repr__(self) -> str:
        return f"<tokenizer {self[0]}>"


@pytest.fixture(scope="session")
def smol(real_gguf):
    """The default model's own tokenizer (SmolLM2, byte-level BPE), built once from its GGUF file."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_gguf.parent, gguf_file=real_gguf.name)


@pytest.fixture(scope="module", params=["smollm2", *_BUILDERS])
def tok(request):
    # Module-scoped, so hypothesis' function-scoped-fixture health check does not apply.
    if request.param == "smollm2":
        return _Named(("smollm2", request.getfixturevalue("smol")))
    return _Named((request.param, _BUILDERS[request.param]()))


def stream(tokenizer, ids, params=None):
    """Feed ids one by one; return (chunks, stop flags, flush text, detokenizer)."""
    det = IncrementalDetokenizer(tokenizer, [1, 2, 3], params or SamplingParams())
    chunks, flags = [], []
    for t in ids:
        text, stop = det.add(t)
        chunks.append(text)
        flags.append(stop)
        if stop:
            break
    return chunks, flags, det.flush(), det


MULTIBYTE = " Hello 世界! 😀🎉 naïve café 👍🏽 — ok\n  日本語 テキスト"


# --------------------------------------------------------------------------- plain streaming


def test_multibyte_streaming_has_no_replacement_chars(tok):
    _, tokenizer = tok
    ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    chunks, flags, rest, det = stream(tokenizer, ids)
    assert not any(flags)
    assert all("\ufffd" not in c for c in chunks)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(chunks) + rest == full == det.text
    assert rest == ""  # nothing pending at a character boundary
    assert det.output_token_ids == ids


def test_token_by_token_decoding_would_break_multibyte(smol):
    # Sanity check that the test above is meaningful for a byte-level BPE.
    ids = smol.encode(MULTIBYTE, add_special_tokens=False)
    assert any("\ufffd" in smol.decode([i]) for i in ids)


def test_leading_space_matches_full_decode(tok):
    name, tokenizer = tok
    ids = tokenizer.encode(" Hello world", add_special_tokens=False)
    chunks, _, rest, _ = stream(tokenizer, ids)
    full = tokenizer.decode(ids)
    assert "".join(chunks) + rest == full
    if name == "metaspace":
        # SentencePiece drops the space of the very first token, and so do we...
        ids = tokenizer.encode("Hello world", add_special_tokens=False)
        chunks, _, _, _ = stream(tokenizer, ids)
        assert chunks[0] == tokenizer.decode(ids[:1]) and not chunks[0].startswith(" ")
        # ...but keeps every later word's space.
        assert "".join(chunks) == "Hello world"
    else:
        assert chunks[0].startswith(" ")


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tok, skip):
    _, tokenizer = tok
    special = tokenizer.all_special_ids
    words = tokenizer.encode(" one 😀 two", add_special_tokens=False)
    ids = [special[0]] + words[:2] + [special[-1]] + words[2:] + [special[0]]
    chunks, _, rest, _ = stream(tokenizer, ids, SamplingParams(skip_special_tokens=skip))
    assert "".join(chunks) + rest == tokenizer.decode(ids, skip_special_tokens=skip)


def test_a_character_cut_at_the_end_is_dropped_not_shown_as_replacement_chars(smol):
    ids = smol.encode("a😀b😀", add_special_tokens=False)
    assert len(ids) >= 5 and smol.decode(ids[:-1]).endswith("\ufffd")
    chunks, _, rest, det = stream(smol, ids[:-1])  # the second emoji cut in the middle
    assert "".join(chunks) + rest == "a😀b" == det.text
    assert det.output_token_ids == ids[:-1]  # the ids stay
    assert det.flush() == ""  # only once
    assert det.add(5) == ("", False)  # ignored after finish


_EXTRA_CHARS = list("世界你好日本語テキスト😀🎉👍🏽🇫🇷é ñ\n\t ") + ["\u200d", "ü"]
text_strategy = st.text(
    alphabet=st.one_of(st.characters(codec="utf-8"), st.sampled_from(_EXTRA_CHARS)), max_size=40
)


@st.composite
def token_ids(draw, tokenizer, random_ids: bool):
    """Ids from encoding random unicode text, optionally with random ids (incl. specials) spliced in."""
    ids = list(tokenizer.encode(draw(text_strategy), add_special_tokens=False))
    if random_ids:
        extra = st.one_of(st.integers(0, len(tokenizer) - 1), st.sampled_from(tokenizer.all_special_ids))
        for _ in range(draw(st.integers(0, 8))):
            ids.insert(draw(st.integers(0, len(ids))), draw(extra))
    return ids


PROPERTY_SETTINGS = settings(
    max_examples=int(os.environ.get("DETOK_EXAMPLES", "100")), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)


@PROPERTY_SETTINGS
@given(data=st.data(), skip=st.booleans())
def test_property_streamed_text_equals_full_decode(tok, data, skip):
    name, tokenizer = tok
    # Byte-fallback (SentencePiece) decoders turn a whole run of byte tokens into
    # U+FFFDs when it holds an invalid sequence anywhere, which no incremental
    # decoder can reproduce; random ids are therefore used on byte-level BPEs only.
    ids = data.draw(token_ids(tokenizer, random_ids=name != "metaspace"))
    chunks, flags, rest, det = stream(tokenizer, ids, SamplingParams(skip_special_tokens=skip))
    assert not any(flags)
    full = tokenizer.decode(ids, skip_special_tokens=skip).rstrip("\ufffd")  # a cut last character is dropped
    assert "".join(chunks) + rest == full
    assert det.text == full
    for c in chunks:
        # U+FFFD may only be streamed when the full text really has one there.
        assert "\ufffd" not in c or "\ufffd" in full


# --------------------------------------------------------------------------- stop strings


def test_stop_string_spanning_tokens(smol):
    ids = smol.encode("The answer is 42. END of story", add_special_tokens=False)
    chunks, flags, rest, det = stream(smol, ids, SamplingParams(stop=["END"]))
    assert flags[-1] and not any(flags[:-1])
    assert len(chunks) < len(ids)  # stopped early
    assert "".join(chunks) + rest == "The answer is 42. "
    assert rest == ""
    assert det.text == "The answer is 42. "
    assert det.stop_reason == "END" and det.stopped and det.finished
    assert det.add(ids[0]) == ("", True)


def test_stop_string_inside_one_token_and_include(smol):
    text = "hello world, hello moon"
    ids = smol.encode(text, add_special_tokens=False)
    chunks, flags, rest, det = stream(smol, ids, SamplingParams(stop="o w", include_stop_str_in_output=True))
    assert flags[-1]
    assert "".join(chunks) + rest == "hello w" == det.text
    chunks, _, rest, det = stream(smol, ids, SamplingParams(stop="o w"))
    assert "".join(chunks) + rest == "hell" == det.text


def test_partial_stop_string_is_held_back_then_released(smol):
    ids = smol.encode("I like cats and", add_special_tokens=False)
    det = IncrementalDetokenizer(smol, [], SamplingParams(stop=" and then"))
    shown = "".join(det.add(t)[0] for t in ids)
    assert shown == "I like cats"  # " and" might begin " and then"
    assert det.text == "I like cats and"
    assert det.flush() == " and"
    assert det.stop_reason is None


def test_only_possible_stop_prefixes_are_held(smol):
    det = IncrementalDetokenizer(smol, [], SamplingParams(stop="XYZW"))
    ids = smol.encode("abc d", add_special_tokens=False)
    shown = "".join(det.add(t)[0] for t in ids)
    assert shown == "abc d"  # nothing there can start "XYZW": no latency added


def test_first_completed_stop_string_wins(smol):
    ids = smol.encode("one two three four", add_special_tokens=False)
    _, flags, _, det = stream(smol, ids, SamplingParams(stop=["three", "two"]))
    assert det.text == "one " and det.stop_reason == "two" and flags[-1]


def test_stop_strings_ignored_before_min_tokens(smol):
    ids = smol.encode("stop here, then stop again", add_special_tokens=False)
    # "stop" completes in the first token: below min_tokens=3, so it doesn't count
    chunks, flags, rest, det = stream(smol, ids, SamplingParams(stop="stop", min_tokens=3))
    assert flags[-1]
    assert det.text == "stop here, then "
    assert "".join(chunks) + rest == det.text


def _cut(full: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    best = None
    for s in stops:
        i = full.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < (best[0] + len(best[1]), best[0])):
            best = (i, s)
    if best is None:
        return full, None
    i, s = best
    return full[: i + len(s) if include else i], s


@PROPERTY_SETTINGS
@given(data=st.data(), include=st.booleans())
def test_property_stop_strings(tok, data, include):
    name, tokenizer = tok
    ids = data.draw(token_ids(tokenizer, random_ids=name != "metaspace"))
    full = tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")  # a cut last character is dropped
    stops = []
    for _ in range(data.draw(st.integers(1, 2))):
        if full and data.draw(st.booleans()):
            i = data.draw(st.integers(0, len(full) - 1))
            j = data.draw(st.integers(i + 1, min(len(full), i + 6)))
            stops.append(full[i:j])  # a substring that really occurs
        else:
            stops.append(data.draw(st.text(alphabet=st.sampled_from(list("ab 世😀\ufffd")), min_size=1, max_size=4)))
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    expected, reason = _cut(full, stops, include)

    det = IncrementalDetokenizer(tokenizer, [], params)
    shown = ""
    hit = False
    for t in ids:
        text, hit = det.add(t)
        shown += text
        # whatever was shown is final: never retracted, never a partial stop string
        assert expected.startswith(shown)
        if hit:
            break
    shown += det.flush()
    assert shown == expected == det.text
    assert det.stop_reason == reason
    if reason is not None and not include:
        assert reason not in shown
    if hit:
        assert reason is not None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), skip=st.booleans())
def test_the_backend_decode_gives_transformers_text(tok, data, skip) -> None:
    """The detokenizer decodes with the Rust tokenizer behind a fast tokenizer (transformers' decode only
    wraps it): the same text as transformers' own decode, special tokens included or skipped."""
    _, tokenizer = tok
    det = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=skip))
    assert det._backend is tokenizer.backend_tokenizer
    ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1), max_size=24))
    assert det._decode(ids) == tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def test_a_tokenizer_with_its_own_decode_keeps_it() -> None:
    from transformers import PreTrainedTokenizerFast

    class Shouting(PreTrainedTokenizerFast):
        def decode(self, token_ids, **kwargs):  # type: ignore[override]
            return super().decode(token_ids, **kwargs).upper()

    base = _bytelevel()
    shouting = Shouting(tokenizer_object=base.backend_tokenizer, eos_token="<|endoftext|>")
    det = IncrementalDetokenizer(shouting, [], SamplingParams())
    assert det._backend is None
    ids = base.encode("def f(x):")
    assert det._decode(ids) == base.decode(ids).upper()
    assert IncrementalDetokenizer(object(), [], SamplingParams())._backend is None  # not a transformers tokenizer


def test_a_decode_set_on_the_tokenizer_object_is_kept() -> None:
    tok = _bytelevel()
    plain = tok.decode
    tok.decode = lambda ids, **kw: plain(ids, **kw).upper()
    det = IncrementalDetokenizer(tok, [], SamplingParams())
    assert det._backend is None
    ids = tok.encode("hello world")
    assert det._decode(ids) == plain(ids).upper()
