"""Pass 22: a hostile model publisher's chat template against the render budget.

A template can build a value that shares one list twice at each level (``[a, a]``): 40 levels are 80 items to build,
but 2**40 to walk. Comparing, sorting or hashing such a value is one C-level operation that walks it whole, holding
the GIL: every thread of the process, the event loop included, stood still for hours, out of reach of the budget
(which counted a comparison by its operands' own lengths, 2 items). It is refused now, as any value past
``MAX_TEMPLATE_VALUE_CHARS``, before the operation runs."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from asyncinfer.models.template_budget import MAX_TEMPLATE_VALUE_CHARS, ChatTemplateLimitError
from asyncinfer.models.tokenizer import compile_chat_template

ROOT = Path(__file__).resolve().parents[2]
LEVELS = 40  # 2**40 items to walk: hours of one C call
DOUBLED = ("{% set ns = namespace(a=[], b=[], t=(), u=()) %}{% for i in range(" + str(LEVELS) + ") %}"
           "{% set ns.a = [ns.a, ns.a] %}{% set ns.b = [ns.b, ns.b] %}"
           "{% set ns.t = (ns.t, ns.t) %}{% set ns.u = (ns.u, ns.u) %}{% endfor %}")
# Each walks both shared values whole (a comparison of equal structures, or a hash of nested tuples).
WALKS = {
    "==": "{{ ns.a == ns.b }}",
    "<": "{{ ns.a < ns.b }}",
    "in a list": "{{ ns.a in [ns.b] }}",
    "not in a list": "{{ ns.a not in [ns.b] }}",
    "eq test": "{{ ns.a is eq(ns.b) }}",
    "in test": "{{ ns.a is in([ns.b]) }}",
    "sort filter": "{{ [ns.a, ns.b] | sort | length }}",
    "max filter": "{{ [ns.a, ns.b] | max | length }}",
    "unique filter": "{{ [ns.t, ns.u] | unique | list | length }}",
    "list.index": "{{ [ns.a, ns.b].index(ns.b) }}",
    "list.count": "{{ [ns.a].count(ns.b) }}",
    "tuple in a dict": "{{ ns.t in {} }}",
    "tuple as a dict key": "{{ {ns.t: 1} | length }}",
    "dict.get": "{{ {}.get(ns.t) }}",
    "subscript": "{{ {'k': 1}[ns.t] }}",
    "dict.fromkeys": "{{ dict.fromkeys([ns.t]) | length }}",
}
CHILD = r"""
import sys, time
from asyncinfer.models.tokenizer import compile_chat_template
start = time.perf_counter()
try:
    compile_chat_template(sys.argv[1]).render(messages=[{"role": "user", "content": "hi"}])
    print("rendered", time.perf_counter() - start)
except BaseException as exc:
    print(type(exc).__name__, time.perf_counter() - start, str(exc)[:300])
"""
CHILD_LIMIT_S = 60  # a walk of 2**40 items takes hours: a child still running then failed the test


@pytest.mark.parametrize("name", list(WALKS))
def test_a_value_sharing_itself_past_the_limit_is_not_compared_or_hashed(name) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run([sys.executable, "-c", CHILD, DOUBLED + WALKS[name]], capture_output=True, text=True,
                              env=env, timeout=CHILD_LIMIT_S, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name}: the render held its thread for over {CHILD_LIMIT_S} s")
    kind, seconds, message = (done.stdout.strip().split(" ", 2) + ["", ""])[:3]
    assert kind == "ChatTemplateLimitError", done.stdout + done.stderr[-2000:]
    assert "MAX_TEMPLATE_VALUE_CHARS" in message and float(seconds) < 10


def test_values_within_the_limit_are_compared_as_before() -> None:
    small = DOUBLED.replace(str(LEVELS), "10")
    out = compile_chat_template(small + "{{ ns.a == ns.b }} {{ ns.t in {ns.u: 1} }} {{ [ns.b, ns.a] | sort | length }}"
                                "{{ ns.a != [] }}").render(messages=[])
    assert out == "True True 2True"
    # 2**21 leaves of one list are 2**22 - 1 items walked: within the limit; one level more is past it
    assert 2 ** 22 - 1 <= MAX_TEMPLATE_VALUE_CHARS
    assert compile_chat_template(DOUBLED.replace(str(LEVELS), "21") + "{{ ns.a == ns.b }}").render(messages=[]) == "True"
    with pytest.raises(ChatTemplateLimitError, match="MAX_TEMPLATE_VALUE_CHARS"):
        compile_chat_template(DOUBLED.replace(str(LEVELS), "22") + "{{ ns.a == ns.b }}").render(messages=[])


def test_a_chats_messages_compare_as_before() -> None:
    """Templates compare messages (``message == messages[-1]``, ``'content' in message``): a chat's whole history
    is far within the limit."""
    messages = [{"role": "user", "content": "x" * 100, "tool_calls": [{"function": {"name": "f", "arguments": {
        "a": [1, 2, 3]}}}]} for _ in range(4096)]
    source = ("{% for m in messages %}{% if m == messages[-1] and 'content' in m and m in messages[-2:] %}"
              "{{ loop.index }}{% endif %}{% endfor %}")
    assert compile_chat_template(source).render(messages=messages) == "".join(str(i) for i in range(1, 4097))


# A template that does not compile: Jinja's syntax, and nesting past Python's recursion limit or its indentation.
UNCOMPILABLE = {
    "syntax": "{% if %}",
    "nested parentheses": "{{ " + "(" * 100 + "1" + ")" * 100 + " }}",
    "nested ifs": "{% if 1 %}" * 100 + "x" + "{% endif %}" * 100,
}


@pytest.mark.parametrize("name", list(UNCOMPILABLE))
def test_a_gguf_template_that_does_not_compile_fails_its_chats_and_its_cached_tokenizer_loads(
        name, tmp_path, monkeypatch) -> None:
    """Such a template failed the cached tokenizer's construction: every load of the file took the cache for damaged,
    warned and built the tokenizer again through transformers (~20 s for a real vocabulary), and got transformers'
    tokenizer. The cache loads now, and each chat fails with what compiling the template raised."""
    import transformers

    from asyncinfer import InvalidParameterError
    from asyncinfer.models.loader import gguf_tokenizer
    from asyncinfer.models.tokenizer import CachedTokenizer
    from asyncinfer.prompts import chat_token_ids
    from tests.models.test_tokenizer import write_tokenizer_gguf

    monkeypatch.setenv("ASYNCINFER_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tokenizer_gguf(tmp_path / "bad.gguf", UNCOMPILABLE[name])
    first = gguf_tokenizer(path)
    assert isinstance(first, CachedTokenizer)

    def built_again(*_: object, **__: object) -> None:
        raise AssertionError("the tokenizer was built again")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", built_again)
    again = gguf_tokenizer(path)
    assert isinstance(again, CachedTokenizer)
    assert again.encode("the capital", add_special_tokens=False) == first.encode("the capital", add_special_tokens=False)
    for _ in range(2):
        with pytest.raises(ValueError, match="the chat template cannot be compiled"):
            again.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
        with pytest.raises(InvalidParameterError, match="cannot be compiled") as err:
            chat_token_ids(types.SimpleNamespace(tokenizer=again), [{"role": "user", "content": "hi"}])
        assert err.value.parameter == "prompt"


@pytest.fixture
def shared_list_chat_model(tiny_models, tmp_path) -> Path:
    """The suite's tiny Llama with a transformers tokenizer whose chat template compares two lists doubled 30 times
    (2**31 items to walk: half a minute of one C call holding the GIL, before the check)."""
    from tests.helpers import with_chat_template

    template = DOUBLED.replace(str(LEVELS), "30") + "{{ ns.a == ns.b }}{% for m in messages %}{{ m.content }}{% endfor %}"
    return with_chat_template(tiny_models["llama"][0], tmp_path / "shared-lists", template)


async def test_a_model_whose_template_compares_shared_lists_fails_its_chats_and_its_neighbour_serves_on(
        tiny_models, shared_list_chat_model) -> None:
    """Beside a good model in one engine: the hostile model's chats fail at once (InvalidParameterError on the
    prompt), its text prompts are served, and the event loop and the good model's requests never wait for it."""
    from asyncinfer import AsyncEngine, InvalidParameterError, SamplingParams
    from tests.helpers import loop_lags

    options = {"kv_cache_memory": 4 << 20, "max_model_len": 256, "dtype": "float32", "device": "cpu"}
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], name="good", **options)
    async with engine:
        await engine.add_model("hostile", shared_list_chat_model, **options)
        greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        alone = await engine.generate([1, 2, 3], greedy, model="good")
        async with loop_lags(0.02) as lags:
            good = asyncio.ensure_future(engine.generate([1, 2, 3], greedy, model="good"))
            for _ in range(3):
                with pytest.raises(InvalidParameterError, match="MAX_TEMPLATE_VALUE_CHARS") as err:
                    await engine.generate([{"role": "user", "content": "Hello world"}], greedy, model="hostile")
                assert err.value.parameter == "prompt"
            beside = await good
        assert beside.token_ids == alone.token_ids
        assert max(lags, default=0.0) < 2.0, lags
        text = await engine.generate("Hello world", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                                     model="hostile")
        assert len(text.token_ids) == 3


def _with_arrays(base: Path, path: Path, arrays: dict[str, int]) -> Path:
    """``base`` (a header without tensors) with metadata arrays of zero bytes (``{key: item count}``, GGUF type
    UINT8) inserted first."""
    import struct

    data = base.read_bytes()
    inserted = b"".join(struct.pack("<Q", len(key)) + key.encode() + struct.pack("<IIQ", 9, 0, count) + bytes(count)
                        for key, count in arrays.items())
    fields = struct.unpack_from("<Q", data, 16)[0]
    path.write_bytes(data[:16] + struct.pack("<Q", fields + len(arrays)) + inserted + data[24:])
    return path


def test_gguf_metadata_arrays_past_max_metadata_items_are_refused_naming_the_key(tmp_path) -> None:
    """A metadata array's items were each made a Python object as the header was read: 8.6 bytes of memory a byte
    of file (a 100 MB array of one-byte items: 860 MB; a 4 GB one, 34 GB), before any check. Their count is held
    to ``MAX_METADATA_ITEMS`` over the whole header, as it is read, naming the key that goes past it."""
    from asyncinfer import ModelLoadError
    from asyncinfer.models.gguf_file import MAX_METADATA_ITEMS, GGUFFile
    from tests.helpers import llama_header_gguf

    writer = llama_header_gguf(tmp_path / "base.gguf", 0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    base = tmp_path / "base.gguf"
    half = MAX_METADATA_ITEMS // 2
    within = GGUFFile(_with_arrays(base, tmp_path / "within.gguf", {"a.first": half, "a.second": half}))
    assert len(within.fields["a.first"]) == half and within.fields["llama.block_count"] == 0
    for name, arrays, key in (("one", {"a.junk": MAX_METADATA_ITEMS + 1}, "a.junk"),
                              ("two", {"a.first": half, "a.second": half + 1}, "a.second")):
        with pytest.raises(ModelLoadError, match=rf"metadata '{key}'.*MAX_METADATA_ITEMS = {MAX_METADATA_ITEMS}"):
            GGUFFile(_with_arrays(base, tmp_path / f"{name}.gguf", arrays))


def test_gguf_merges_the_tokenizers_library_panics_on_are_a_model_load_error(tmp_path, monkeypatch) -> None:
    """Merges whose pieces run into each other (``abc ab`` where no ``abcab`` is a token) make the tokenizers
    library's Rust code panic as transformers builds the tokenizer: a ``PanicException``, a ``BaseException`` that
    went past the load's ``except Exception`` and out of ``AsyncEngine.load``/``add_model`` as it was."""
    import gguf

    from asyncinfer import ModelLoadError
    from asyncinfer.models.loader import gguf_tokenizer

    monkeypatch.setenv("ASYNCINFER_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "merges.gguf"
    tokens = ["<s>", "</s>", "a", "b", "c", "ab", "abc", "\u0120", *(f"t{i}" for i in range(24))]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_vocab_size(len(tokens))
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    writer.add_token_merges(["a b", "ab c", "abc ab", "a bc"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"cannot build a tokenizer from GGUF file .*merges\.gguf.*panicked"):
        gguf_tokenizer(path)
