"""Adversarial pass 6: faults one caller could cause for others (or for the process), found and fixed.

The kernels' public entries (``DecodeLayer``, ``DecodeStack``, ``gemm``, ``BlockTable``) handed compiled code
pointers and format codes read from a caller's containers and strings more than once: a ``list`` / ``tuple``
subclass whose ``__len__``, ``__iter__`` or ``__getitem__`` answered differently, or a ``str`` subclass whose
``__hash__`` / ``__eq__`` / ``__format__`` named one format to the checks and another to the call, made the
kernel read past an array or a tensor (SIGSEGV, or another tensor's bytes). Each case runs in a forked child of
one subprocess (this file run as a script), so a crash is a failed case, not a dead test run.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------- hostile containers and names
class _LenTwo(list):
    """A list that says it holds 2 items, whatever it holds."""

    def __len__(self) -> int:
        return 2


class _TupleLenTwo(tuple):
    """A tuple that says it holds 2 items, whatever it holds."""

    def __len__(self) -> int:
        return 2


class _IndexesAsAnother(tuple):
    """A tuple that iterates as itself and indexes as ``other`` (another spec)."""

    other: tuple = ()

    def __getitem__(self, i):  # type: ignore[override]
        return self.other[i]


class _FlippingName(str):
    """A format name that hashes as ``first`` for its first ``calls`` lookups, then as ``then``, equal to any
    name, and formats as ``then``: the checks see one format, whatever reads it later another."""

    first, then, calls, seen = "q4_0", "q8_0", 0, 0

    def __hash__(self) -> int:
        type(self).seen += 1
        return hash(self.first if type(self).seen <= self.calls else self.then)

    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return False

    def __format__(self, spec: str) -> str:
        return self.then


class _RaisingHash(str):
    def __hash__(self) -> int:
        raise RuntimeError("a name whose hash raises")


# ----------------------------------------------------------------- the cases (run in forked children)
def _stack_with_second_rope_table():
    from asyncinfer import kernels
    from tests.models.kernel_cases import HIDDEN, VOCAB, blocks, tiny_layer

    return kernels.DecodeStack([tiny_layer(), tiny_layer(rope_table=1)], torch.ones(HIDDEN), 1e-5,
                               ("q8_0", blocks(VOCAB, HIDDEN, "q8_0", 99), VOCAB))


def _kv_caches_len_lies() -> None:
    from tests.models.kernel_cases import _packed, tables

    _packed(kv_caches=_LenTwo(tables()[3][:1]))  # one pair for two layers


def _rope_tables_len_lies() -> None:
    from tests.models.kernel_cases import _packed, tables

    _, cos, sin, _ = tables()
    _packed(stack=_stack_with_second_rope_table(), cos_table=_TupleLenTwo((cos,)), sin_table=(sin, sin))


def _logits(layer) -> torch.Tensor:
    from asyncinfer import kernels
    from tests.models.kernel_cases import HIDDEN, VOCAB, _packed, blocks

    stack = kernels.DecodeStack([layer], torch.ones(HIDDEN), 1e-5, ("q8_0", blocks(VOCAB, HIDDEN, "q8_0", 99), VOCAB))
    from tests.models.kernel_cases import tables

    embed, cos, sin, caches = tables(1)
    return _packed(stack=stack, embed=embed, cos_table=cos, sin_table=sin, kv_caches=caches)[0]


def _projection_indexes_as_other_blocks() -> bool:
    """``gate_up`` iterates as its blocks and indexes as a one-row copy (dropped after the build): the layer
    read the checked blocks' pointers and kept the other, freed as the caller's references go."""
    from asyncinfer import kernels
    from tests.models.kernel_cases import layer_args

    args = layer_args()
    expected = _logits(kernels.DecodeLayer(**layer_args()))
    fmt, b, bias = args["gate_up"]
    spec = _IndexesAsAnother((fmt, b.clone(), bias))
    spec.other = (fmt, b[:1].clone(), bias)
    args["gate_up"] = spec
    layer = kernels.DecodeLayer(**args)
    del args, spec, b
    junk = [torch.full((4096,), 255, dtype=torch.uint8) for _ in range(64)]  # reuse what was freed
    got = _logits(layer)
    del junk
    return torch.equal(got, expected)


def _head_indexes_as_other_blocks() -> bool:
    from asyncinfer import kernels
    from tests.models.kernel_cases import HIDDEN, VOCAB, _packed, blocks, tiny_layer

    head = blocks(VOCAB, HIDDEN, "q8_0", 99)
    spec = _IndexesAsAnother(("q8_0", head, VOCAB))
    spec.other = ("q8_0", head[:1].clone(), VOCAB)
    stack = kernels.DecodeStack([tiny_layer()], torch.ones(HIDDEN), 1e-5, spec)
    plain = kernels.DecodeStack([tiny_layer()], torch.ones(HIDDEN), 1e-5, ("q8_0", head, VOCAB))
    from tests.models.kernel_cases import tables

    embed, cos, sin, caches = tables(1)
    got = _packed(stack=stack, embed=embed, cos_table=cos, sin_table=sin, kv_caches=caches)[0]
    embed, cos, sin, caches = tables(1)
    return torch.equal(got, _packed(stack=plain, embed=embed, cos_table=cos, sin_table=sin, kv_caches=caches)[0])


def _flipping(calls: int) -> _FlippingName:
    _FlippingName.calls, _FlippingName.seen = calls, 0
    return _FlippingName("q4_0")


def _q4_0_o_projection() -> tuple:
    from asyncinfer import kernels
    from tests.models.kernel_cases import HEAD_DIM, HEADS, HIDDEN

    gen = torch.Generator().manual_seed(7)
    w = torch.randn(HIDDEN, HEADS * HEAD_DIM, generator=gen) * 0.1
    return kernels.pack(kernels.quantize(w, "q4_0"), "q4_0")


def _layer_format_flips(calls: int) -> Callable[[], bool]:
    """``o`` in Q4_0 blocks named by a str that hashes as q4_0 for the checks and as q8_0 after ``calls`` lookups:
    the kernel read the Q4_0 blocks as Q8_0 (34 bytes a block for 18), past the end of the tensor."""

    def run() -> bool:
        from asyncinfer import kernels
        from tests.models.kernel_cases import layer_args

        o = _q4_0_o_projection()
        expected = _logits(kernels.DecodeLayer(**{**layer_args(), "o": ("q4_0", o, None)}))
        return torch.equal(_logits(kernels.DecodeLayer(**{**layer_args(), "o": (_flipping(calls), o, None)})),
                           expected)

    return run


def _gemm_format_formats_as_another() -> bool:
    """gemm's ``fmt`` checked as q4_0 and formatted as q8_0 into the compiled function's name."""
    from asyncinfer import kernels

    w = _q4_0_o_projection()
    x = torch.randn(3, w.shape[1] // 18 * 32, generator=torch.Generator().manual_seed(1))
    expected = kernels.gemm(x, w, "q4_0", w.shape[0])
    return torch.equal(kernels.gemm(x, w, _flipping(10**9), w.shape[0]), expected)


def _block_table_format_flips() -> bool:
    """An embedding BlockTable whose ``fmt`` reads as q4_0 to its checks and q8_0 to the row gather."""
    from asyncinfer import kernels
    from tests.models.kernel_cases import HIDDEN, VOCAB

    rows = kernels.quantize(torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(3)), "q4_0")
    ids = torch.tensor([VOCAB - 1, 0], dtype=torch.int64)
    expected = kernels.embed_rows(kernels.BlockTable(rows, "q4_0"), ids, 1.0)
    table = kernels.BlockTable(rows, "q4_0")
    table.fmt = _flipping(2)
    return torch.equal(kernels.embed_rows(table, ids, 1.0), expected)


def _activation_hash_raises() -> bool:
    """``activation`` a str subclass whose hash raises: read as the plain name it holds."""
    from asyncinfer import kernels
    from tests.models.kernel_cases import layer_args

    expected = _logits(kernels.DecodeLayer(**{**layer_args(), "activation": "gelu_tanh"}))
    return torch.equal(_logits(kernels.DecodeLayer(**{**layer_args(), "activation": _RaisingHash("gelu_tanh")})),
                       expected)


class _OwnPointer(torch.Tensor):
    """A tensor subclass whose ``data_ptr`` names another address."""

    def data_ptr(self) -> int:  # type: ignore[override]
        return 16


class _OwnShape(torch.Tensor):
    """A tensor subclass that says it holds a million rows."""

    @property
    def shape(self) -> torch.Size:  # type: ignore[override]
        return torch.Size([1 << 20, *torch.Tensor.size(self)[1:]])


class _Plain(torch.Tensor):
    """A tensor subclass that changes nothing the kernels read."""


def _gemm_of(x: torch.Tensor) -> bool:
    from asyncinfer import kernels
    from tests.models.kernel_cases import blocks

    w = blocks(8, 64)
    return torch.equal(kernels.gemm(x, w, "q4_1", 8), kernels.gemm(x.as_subclass(torch.Tensor), w, "q4_1", 8))


def _stack_caches_of(cls: type) -> None:
    from tests.models.kernel_cases import _packed, tables

    caches = tables()[3]
    _packed(kv_caches=[(k.as_subclass(cls), v) for k, v in caches])


#: case -> (the call, what it must do: ("raises", error type name, a word its message names) or ("returns True",)).
KERNEL_CASES: dict[str, tuple[Callable[[], object], tuple]] = {
    "kv_caches a list whose __len__ lies": (_kv_caches_len_lies, ("raises", "ValueError", "kv_caches")),
    "rope tables a tuple whose __len__ lies": (_rope_tables_len_lies, ("raises", "TypeError", "cos_table")),
    "a projection that indexes as other blocks": (_projection_indexes_as_other_blocks, ("returns True",)),
    "a head that indexes as other blocks": (_head_indexes_as_other_blocks, ("returns True",)),
    **{f"a layer's format name that flips after {n} lookups": (_layer_format_flips(n), ("returns True",))
       for n in range(1, 9)},
    "gemm's format name that formats as another": (_gemm_format_formats_as_another, ("returns True",)),
    "a block table's format name that flips": (_block_table_format_flips, ("returns True",)),
    "an activation whose hash raises": (_activation_hash_raises, ("returns True",)),
    "gemm's x a tensor subclass with its own data_ptr": (
        lambda: _gemm_of(torch.randn(2, 64).as_subclass(_OwnPointer)), ("raises", "TypeError", "x")),
    "gemm's x a tensor subclass with its own shape": (
        lambda: _gemm_of(torch.randn(2, 64).as_subclass(_OwnShape)), ("raises", "TypeError", "x")),
    "a stack's cache a tensor subclass with its own data_ptr": (
        lambda: _stack_caches_of(_OwnPointer), ("raises", "TypeError", "kv_caches[0][0]")),
    "gemm's x a tensor subclass that changes nothing": (
        lambda: _gemm_of(torch.randn(2, 64).as_subclass(_Plain)), ("returns True",)),
    "gemm's x an nn.Parameter": (
        lambda: _gemm_of(torch.nn.Parameter(torch.randn(2, 64), requires_grad=False)), ("returns True",)),
}


def _main() -> None:
    from asyncinfer import kernels
    from tests.models.kernel_cases import run_forked, tiny_stack

    assert kernels.available(), kernels.unavailable_reason()
    tiny_stack()  # the kernels loaded once, before any fork

    def checked(fn: Callable[[], object], want: tuple) -> Callable[[], None]:
        def run() -> None:
            out = fn()
            if want[0] == "returns True" and out is not True:
                raise AssertionError(f"returned {out!r}")
        return run

    json.dump({name: run_forked(checked(fn, want)) for name, (fn, want) in KERNEL_CASES.items()}, sys.stdout)


@pytest.fixture(scope="module")
def kernel_outcomes() -> dict:
    import subprocess

    path = os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, __file__], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": path}, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_a_kernel_entry_reads_a_callers_containers_and_names_once(kernel_outcomes, case) -> None:
    """Every pointer and format code a kernel call uses comes from the values the checks looked at: a lying
    container or name is refused by name, or read as what it holds; never a crash or another tensor's bytes."""
    outcome, want = kernel_outcomes[case], KERNEL_CASES[case][1]
    assert "signal" not in outcome and "exit" not in outcome, f"{case}: the process died: {outcome}"
    if want[0] == "raises":
        assert outcome.get("raised") == want[1], f"{case}: {outcome}"
        assert want[2] in outcome["message"], f"{case}: {outcome['message']!r} does not name {want[2]!r}"
    else:
        assert outcome == {"returned": True}, f"{case}: {outcome}"


# ----------------------------------------------------------------- chat messages
def _word_tokenizer(template: str):
    """A CachedTokenizer over a word-level vocabulary (no files), with ``template`` as its chat template."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from tokenizers.processors import TemplateProcessing

    from asyncinfer.models.tokenizer import CachedTokenizer

    backend = Tokenizer(WordLevel({"[UNK]": 0, "user": 1, "hi": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = Whitespace()
    backend.post_processor = TemplateProcessing(single="$A")
    return CachedTokenizer(backend, {}, template)


@pytest.mark.parametrize("message", [
    {"role": "user", "content": "hi", "name": "\ud800"},
    {"role": "assistant", "content": "hi", "reasoning": "\udc00"},
    {"role": "user", "content": "hi", "\ud800": "x"},
    {"role": "user", "content": "hi", "name": ["nested \ud800"]},
])
def test_a_lone_surrogate_in_any_key_a_template_renders_is_refused_by_name(message) -> None:
    """A chat message's role and content were checked for lone surrogates, not its other keys: a template that
    renders them (``name``, the reasoning Qwen3's renders) handed the tokenizer a text it cannot encode, and the call
    failed with the tokenizers library's bare TypeError ("TextEncodeInput must be ...")."""
    from types import SimpleNamespace

    from asyncinfer.errors import InvalidParameterError
    from asyncinfer.prompts import chat_token_ids, plain_prompt

    template = ("{% for m in messages %}{% for k, v in m.items() %}{{ k }} {% if v is string %}{{ v }}{% else %}"
                "{{ v | join(' ') }}{% endif %} {% endfor %}{% endfor %}")
    version = SimpleNamespace(tokenizer=_word_tokenizer(template))
    with pytest.raises(InvalidParameterError) as refused:
        chat_token_ids(version, plain_prompt([message]))  # type: ignore[arg-type]
    assert refused.value.parameter in ("prompt[0]", "prompt")
    assert chat_token_ids(version, [{"role": "user", "content": "hi", "name": "hi"}])  # type: ignore[arg-type]


# ----------------------------------------------------------------- endless sequences
class _Endless(Sequence):
    """A sequence whose ``__getitem__`` never raises IndexError (and whose ``__len__`` says 1): read whole, it never
    ends. It stops the test (RuntimeError) once read far past any limit, where the process would run out of memory."""

    def __init__(self, item: object) -> None:
        self.item = item

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i):  # type: ignore[override]
        if i > 200_000:
            raise RuntimeError("read 200,000 items of an endless sequence")
        return self.item


@pytest.mark.parametrize("call", ["prompt of token ids", "chat prompt", "embed texts"])
def test_an_endless_sequence_is_refused_by_name_after_a_bounded_read(monkeypatch, call) -> None:
    """A prompt or embed() texts given as a sequence (not a list or a tuple) were read whole with ``list()`` on the
    caller's loop: one whose ``__getitem__`` never raises IndexError held that loop, and every request it serves,
    while the list grew until memory ran out. It is read up to MAX_SEQUENCE_ITEMS items, then refused by name."""
    from asyncinfer import prompts
    from asyncinfer.errors import InvalidParameterError

    monkeypatch.setattr(prompts, "MAX_SEQUENCE_ITEMS", 1000, raising=False)
    with pytest.raises(InvalidParameterError) as refused:
        if call == "embed texts":
            prompts.check_texts(_Endless("text"))
        else:
            prompts.plain_prompt(_Endless(5 if call == "prompt of token ids" else {"role": "user", "content": "hi"}))
    assert refused.value.parameter == ("texts" if call == "embed texts" else "prompt")
    assert prompts.plain_prompt(_Short()) == [1, 2, 3]


def test_an_endless_sequence_of_choices_is_refused_by_name_after_a_bounded_read() -> None:
    """``StructuredOutput.choice`` counted the choices by ``__len__`` (1 here), then read them whole: forever."""
    from asyncinfer.errors import InvalidParameterError
    from asyncinfer.structured import StructuredOutput

    with pytest.raises(InvalidParameterError) as refused:
        StructuredOutput.choice(_Endless("yes"))
    assert refused.value.parameter == "structured"


class _Short(Sequence):
    def __len__(self) -> int:
        return 3

    def __getitem__(self, i):  # type: ignore[override]
        return [1, 2, 3][i]


if __name__ == "__main__":
    _main()
