"""The "triton" attention backend (decodes in a Triton paged-attention kernel) against the SDPA backend
and a float64 reference, its checks before launch, and its selection.

On a CPU the kernel runs in Triton's interpreter. Triton picks interpreting over compiling when a kernel
is defined, from ``TRITON_INTERPRET``, so the interpreted runs happen in one subprocess
(``tests/models/triton_interpret_worker.py``, started with ``TRITON_INTERPRET=1`` in its own environment):
setting the variable in this process would reach every later test that imports Triton. This process builds
the cases, the worker runs them, and the comparisons are made here. The checks before launch need no
interpreter: they raise before anything runs (a launch on CPU tensors outside the interpreter would fail
with Triton's own error, not ``InvalidParameterError``).

Tolerances (random normal inputs; outputs of magnitude ~1): the kernel against the float64 reference within
1e-5 in float32, 1e-2 in bfloat16 and 2e-3 in float16 (the kernel computes in float32 and rounds its output
once: half an ulp of bfloat16 is 0.4%), each with the same relative tolerance; against the SDPA backend
within twice that (SDPA's own rounding on top). Measured on the interpreter: at most 6e-7 in float32,
1.6e-2 in bfloat16 and 1e-3 in float16 from SDPA. The ``cuda`` test does the same comparisons on the device
(scripts/gpu_check.sh).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import asyncinfer
from asyncinfer.errors import InvalidParameterError
from asyncinfer.models.attention import select_attention_backend
from asyncinfer.models.attention.sdpa import SdpaBackend
from asyncinfer.models.attention.triton_backend import TritonDecodeBackend
from asyncinfer.models.attention.triton_decode import DecodeBounds, paged_decode_attention

WORKER = Path(__file__).with_name("triton_interpret_worker.py")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Spec:
    """One case: ``plan`` is (cached prefix, new tokens) per sequence, decodes (new == 1) first; a
    "kernel" case is decodes only and calls the kernel directly, a "backend" case goes through
    ``TritonDecodeBackend`` (build_metadata, forward: K/V written, prefill chunks in SDPA)."""

    kind: str
    dtype: torch.dtype
    head_dim: int
    group: int  # query heads per KV head
    kv_heads: int
    block_size: int
    plan: tuple[tuple[int, int], ...]
    window: int | None = None
    softcap: float | None = None
    seed: int = 0

    @property
    def id(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        extra = (f"-w{self.window}" if self.window else "") + (f"-cap{self.softcap:g}" if self.softcap else "")
        return (f"{self.kind}-{dt}-d{self.head_dim}-g{self.group}-kvh{self.kv_heads}-bs{self.block_size}"
                f"-b{len(self.plan)}{extra}")


def _decode_plan(seed: int, batch: int, block_size: int) -> tuple[tuple[int, int], ...]:
    """``batch`` decodes whose contexts (1 .. 3 blocks and a bit) start with 1, a full block and one past it."""
    rng = random.Random(seed)
    lens = [1, block_size, block_size + 1, 3 * block_size + 2][:batch]
    lens += [rng.randint(1, 3 * block_size + 2) for _ in range(batch - len(lens))]
    rng.shuffle(lens)
    return tuple((n - 1, 1) for n in lens)


def _kernel_specs() -> list[Spec]:
    specs = []
    grid = [(dtype, head_dim, group) for dtype in DTYPES for head_dim in (64, 128) for group in (1, 3, 4)]
    for i, (dtype, head_dim, group) in enumerate(grid):
        block_size = (16, 5, 4)[i % 3]  # 5: not a power of two (the kernel masks the extra lanes)
        batch = 1 + i % 8
        specs.append(Spec("kernel", dtype, head_dim, group, 1 + i % 2, block_size,
                          _decode_plan(i, batch, block_size), seed=i))
    specs.append(Spec("kernel", torch.float32, 64, 4, 2, 4, _decode_plan(40, 6, 4), window=5, seed=40))
    specs.append(Spec("kernel", torch.bfloat16, 128, 3, 1, 16, _decode_plan(41, 5, 16), window=20, seed=41))
    specs.append(Spec("kernel", torch.float32, 64, 3, 2, 5, _decode_plan(42, 4, 5), softcap=2.0, seed=42))
    specs.append(Spec("kernel", torch.float16, 64, 1, 2, 4, _decode_plan(43, 3, 4), window=3, softcap=3.0, seed=43))
    return specs


MIXED = ((6, 1), (0, 1), (12, 1), (0, 5), (4, 6))  # three decodes, a fresh prompt, a chunk after a cached prefix


def _backend_specs() -> list[Spec]:
    return [
        Spec("backend", torch.float32, 64, 3, 2, 4, MIXED, seed=50),
        Spec("backend", torch.bfloat16, 128, 4, 1, 16, MIXED, seed=51),
        Spec("backend", torch.float32, 64, 3, 2, 4, MIXED, window=4, seed=52),
        Spec("backend", torch.float32, 64, 1, 2, 5, MIXED, softcap=2.5, seed=53),
        Spec("backend", torch.bfloat16, 64, 4, 2, 4, MIXED, window=5, softcap=2.5, seed=54),
        Spec("backend", torch.float16, 128, 3, 1, 4, ((9, 1), (3, 1), (0, 1)), window=3, seed=55),  # decodes only
    ]


SPECS = {spec.id: spec for spec in _kernel_specs() + _backend_specs()}


@dataclass
class Case:
    """A spec's tensors: each sequence's whole K/V (``keys[i]``, ``values[i]``: [ctx, KVH, D]) scattered into
    caches of stale values; ``q`` [T, H, D] (T: the step's new tokens); the new tokens' ``k``/``v`` and slots."""

    spec: Spec
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    tables: list[list[int]]
    slots: list[int]

    @property
    def context_lens(self) -> list[int]:
        return [p + n for p, n in self.spec.plan]

    def worker_input(self) -> dict:
        spec = self.spec
        common = {"kind": spec.kind, "scale": spec.head_dim**-0.5, "window": spec.window, "softcap": spec.softcap,
                  "q": self.q, "k_cache": self.k_cache, "v_cache": self.v_cache}
        if spec.kind == "kernel":  # the new K/V are in the cache already: the kernel only reads
            width = max(map(len, self.tables))
            index = torch.int32 if spec.seed % 2 else torch.int64
            padded = [t + [0] * (width - len(t)) for t in self.tables]
            tables = torch.tensor(padded, dtype=index, device=self.q.device)
            lens = torch.tensor(self.context_lens, dtype=index, device=self.q.device)
            if spec.seed % 3 == 0:  # strided views (the kernel takes every tensor's strides; torch.save keeps them)
                common["q"] = torch.cat([self.q, torch.zeros_like(self.q)], dim=-1)[..., : spec.head_dim]
                tables = tables.t().contiguous().t()  # column-major
                lens = torch.stack([lens, lens], dim=1)[:, 0]  # stride 2
            return {**common, "block_tables": tables, "context_lens": lens}
        return {**common, "k": self.k, "v": self.v, "query_lens": [n for _, n in spec.plan],
                "context_lens": self.context_lens, "block_tables": self.tables, "slot_mapping": self.slots}


def make_case(spec: Spec, device: str = "cpu") -> Case:
    gen = torch.Generator().manual_seed(spec.seed)
    rng = random.Random(spec.seed)
    kvh, d, bs = spec.kv_heads, spec.head_dim, spec.block_size
    heads = kvh * spec.group
    lens = [p + n for p, n in spec.plan]
    needed = [-(-n // bs) for n in lens]
    num_blocks = sum(needed) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(spec.dtype).to(device)

    k_cache, v_cache = randn(num_blocks, bs, kvh, d, scale=4.0), randn(num_blocks, bs, kvh, d, scale=4.0)  # stale
    keys = [randn(n, kvh, d) for n in lens]
    values = [randn(n, kvh, d) for n in lens]
    tables, slots, new_k, new_v = [], [], [], []
    for i, ((prefix, new), n) in enumerate(zip(spec.plan, lens)):
        table = [free.pop() for _ in range(needed[i])] + ([free[-1]] if i % 2 else [])  # some tables longer
        tables.append(table)
        cached = n if spec.kind == "kernel" else prefix  # a backend case writes the new tokens itself
        for pos in range(n):
            slot = table[pos // bs] * bs + pos % bs
            if pos < cached:
                k_cache.view(-1, kvh, d)[slot] = keys[i][pos]
                v_cache.view(-1, kvh, d)[slot] = values[i][pos]
            if pos >= prefix:
                slots.append(slot)
        new_k.append(keys[i][prefix:])
        new_v.append(values[i][prefix:])
    q = randn(sum(n for _, n in spec.plan), heads, d)
    return Case(spec, q, torch.cat(new_k), torch.cat(new_v), keys, values, k_cache, v_cache, tables, slots)


def reference(case: Case) -> torch.Tensor:
    """float64, one query at a time: scores, soft cap, the window, softmax, weighted values. [T, H, D]."""
    spec = case.spec
    out = torch.empty(case.q.shape, dtype=torch.float64)
    row = 0
    for (prefix, new), keys, values in zip(spec.plan, case.keys, case.values):
        for j in range(new):
            pos = prefix + j
            first = 0 if spec.window is None else max(0, pos - spec.window + 1)
            for h in range(case.q.shape[1]):
                kv = h // spec.group
                k = keys[first : pos + 1, kv].double().cpu()  # [n, D]
                v = values[first : pos + 1, kv].double().cpu()
                scores = k @ case.q[row, h].double().cpu() * spec.head_dim**-0.5  # [n]
                if spec.softcap is not None:
                    scores = torch.tanh(scores / spec.softcap) * spec.softcap
                out[row, h] = torch.softmax(scores, dim=0) @ v
            row += 1
    return out


def sdpa_output(case: Case) -> torch.Tensor:
    """The SDPA backend on the same step (its own copies of the caches)."""
    spec = case.spec
    backend = SdpaBackend()
    meta = backend.build_metadata(query_lens=[n for _, n in spec.plan], context_lens=case.context_lens,
                                  block_tables=case.tables, slot_mapping=case.slots, block_size=spec.block_size,
                                  device=case.q.device)
    return backend.forward(case.q, case.k, case.v, (case.k_cache.clone(), case.v_cache.clone()), meta,
                           spec.head_dim**-0.5, window=spec.window, softcap=spec.softcap)


def sdpa_tolerance(spec: Spec) -> float:
    return 2 * TOL[spec.dtype]


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Case, torch.Tensor]]:
    """Every spec's case, and the kernel's (or the Triton backend's) output from Triton's interpreter."""
    cases = {name: make_case(spec) for name, spec in SPECS.items()}
    folder = tmp_path_factory.mktemp("triton_interpret")
    torch.save([case.worker_input() for case in cases.values()], folder / "cases.pt")
    src = str(Path(asyncinfer.__file__).resolve().parents[1])  # the asyncinfer this process tests
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(WORKER), str(folder / "cases.pt"), str(folder / "out.pt")],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    outputs = torch.load(folder / "out.pt")
    assert len(outputs) == len(cases)
    for case, (_, strides) in zip(cases.values(), outputs):  # the worker ran the tensors as they were sent
        sent = case.worker_input()
        assert strides == {name: tuple(value.stride()) for name, value in sent.items()
                           if isinstance(value, torch.Tensor)}
    return {name: (case, out) for (name, case), (out, _) in zip(cases.items(), outputs)}


@pytest.mark.parametrize("name", list(SPECS))
def test_interpreted_kernel_matches_reference_and_sdpa(interpreted, name: str) -> None:
    case, out = interpreted[name]
    spec = case.spec
    assert out.shape == case.q.shape and out.dtype == spec.dtype
    assert torch.isfinite(out).all()
    if spec.kind == "kernel" and spec.seed % 3 == 0:  # the strided views it claims (their strides reached the worker)
        sent = case.worker_input()
        num_seqs, num_heads, head_dim = case.q.shape
        assert sent["q"].stride() == (2 * num_heads * head_dim, 2 * head_dim, 1)
        assert sent["block_tables"].stride() == (1, num_seqs) and sent["context_lens"].stride() == (2,)
    tol = TOL[spec.dtype]
    torch.testing.assert_close(out.double(), reference(case), atol=tol, rtol=tol)
    sdpa_tol = sdpa_tolerance(spec)
    torch.testing.assert_close(out.double(), sdpa_output(case).double(), atol=sdpa_tol, rtol=sdpa_tol)


def test_the_specs_cover_the_asked_shapes() -> None:
    """GQA ratios 1/3/4, head sizes 64/128, batches 1..8, every dtype, contexts of 1 and across block
    boundaries, windows and soft caps: in the kernel cases and through the backend."""
    kernel = [s for s in SPECS.values() if s.kind == "kernel"]
    assert {s.group for s in kernel} == {1, 3, 4} and {s.head_dim for s in kernel} == {64, 128}
    assert {len(s.plan) for s in kernel} == set(range(1, 9)) and {s.dtype for s in kernel} == set(DTYPES)
    lens = {(p + n, s.block_size) for s in kernel for p, n in s.plan}
    assert any(n == 1 for n, _ in lens) and any(n == bs for n, bs in lens) and any(n > 2 * bs for n, bs in lens)
    backend = [s for s in SPECS.values() if s.kind == "backend"]
    assert any(s.window for s in backend) and any(s.softcap for s in backend) and any(s.window for s in kernel)


def _decode_args(device: str = "cpu") -> dict:
    case = make_case(Spec("kernel", torch.float32, 64, 2, 2, 4, ((5, 1), (0, 1), (8, 1))))
    return {"q": case.q, "k_cache": case.k_cache, "v_cache": case.v_cache,
            "block_tables": torch.tensor([t + [0] * (4 - len(t)) for t in case.tables]),
            "context_lens": torch.tensor(case.context_lens), "scale": 0.125}


def _call(**changes: object) -> None:
    args = {**_decode_args(), **changes}
    window, softcap = args.pop("window", None), args.pop("softcap", None)
    paged_decode_attention(**args, window=window, softcap=softcap)


@pytest.mark.parametrize(("changes", "parameter"), [
    ({"q": torch.zeros(3, 4 * 64)}, "q"),
    ({"k_cache": torch.zeros(8, 4, 2)}, "k_cache"),
    ({"v_cache": torch.zeros(12, 4, 2, 64)}, "v_cache"),
    ({"q": torch.zeros(3, 4, 64, dtype=torch.float64)}, "q.dtype"),
    ({"k_cache": torch.zeros(9, 4, 2, 64, dtype=torch.float16),
      "v_cache": torch.zeros(9, 4, 2, 64, dtype=torch.float16)}, "k_cache.dtype"),
    ({"q": torch.zeros(3, 4, 32)}, "q.shape[2]"),
    ({"q": torch.zeros(3, 5, 64)}, "q.shape[1]"),
    ({"block_tables": torch.zeros(2, 4, dtype=torch.long)}, "block_tables"),
    ({"block_tables": torch.zeros(3, 4)}, "block_tables"),
    ({"context_lens": torch.tensor([6, 1])}, "context_lens"),
    ({"context_lens": torch.tensor([6.0, 1.0, 9.0])}, "context_lens"),
    ({"context_lens": torch.tensor([6, 0, 9])}, "context_lens"),
    ({"context_lens": torch.tensor([6, 1, 17])}, "context_lens"),  # past the tables' 4 blocks of 4
    ({"block_tables": torch.tensor([[0, 9, 0, 0], [1, 0, 0, 0], [2, 3, 4, 0]])}, "block_tables"),  # block 9 of 9
    ({"block_tables": torch.tensor([[0, 1, 0, 0], [-1, 0, 0, 0], [2, 3, 4, 0]])}, "block_tables"),
    ({"scale": float("nan")}, "scale"),
    ({"scale": 0.0}, "scale"),
    ({"window": 0}, "window"),
    ({"softcap": -1.0}, "softcap"),
])
def test_bad_inputs_are_refused_before_launch(changes: dict, parameter: str) -> None:
    with pytest.raises(InvalidParameterError) as info:
        _call(**changes)
    assert info.value.parameter == parameter


def test_a_block_id_past_the_read_part_of_a_table_is_not_refused_by_the_bounds() -> None:
    """Entries of a table past its context are never read: any value there passes the check."""
    tables = torch.tensor([[0, 1, 99, -5], [2, 0, 0, 0], [3, 4, 5, 77]])
    bounds = DecodeBounds.from_tensors(tables, torch.tensor([5, 1, 9]), 4)
    assert bounds == DecodeBounds(0, 5, 1, 9)
    assert DecodeBounds.from_lists([[0, 1, 99, -5], [2], [3, 4, 5, 77]], [5, 1, 9], 4) == bounds


def test_the_backend_refuses_a_table_past_the_cache_before_writing() -> None:
    case = make_case(Spec("backend", torch.float32, 64, 2, 2, 4, ((5, 1), (0, 3))))
    backend = TritonDecodeBackend()
    tables = [[case.k_cache.shape[0]] + case.tables[0][1:], case.tables[1]]  # the decode's first block: past the end
    meta = backend.build_metadata(query_lens=[1, 3], context_lens=case.context_lens, block_tables=tables,
                                  slot_mapping=case.slots, block_size=4, device="cpu")
    before = case.k_cache.clone()
    with pytest.raises(InvalidParameterError) as info:
        backend.forward(case.q, case.k, case.v, (case.k_cache, case.v_cache), meta, 0.125)
    assert info.value.parameter == "block_tables"
    assert torch.equal(case.k_cache, before)  # nothing written


def test_the_backend_metadata_carries_the_decodes_bounds_and_pads_nothing() -> None:
    backend = TritonDecodeBackend()
    meta = backend.build_metadata(query_lens=[1, 1, 4], context_lens=[5, 2, 4], block_tables=[[7, 3], [2], [4, 9]],
                                  slot_mapping=[13, 9, 16, 17, 18, 19], block_size=4, device="cpu")
    assert meta.backend is backend and meta.num_decodes == 2 and meta.decode_mask is None
    assert meta.decode_bounds == DecodeBounds(2, 7, 2, 5)
    assert backend.decode_padding([5, 2, 17], 4) == 0 and SdpaBackend.decode_padding([5, 2], 4) == 9


def test_triton_is_opt_in_on_cuda_and_never_the_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    # Not CUDA's default until a device run confirms it (tested through the interpreter only): by name.
    assert type(select_attention_backend("cuda")) is SdpaBackend
    assert type(select_attention_backend("cuda", "triton")) is TritonDecodeBackend
    assert type(select_attention_backend(torch.device("cuda", 0), "triton")) is TritonDecodeBackend
    assert type(select_attention_backend("cpu")) is SdpaBackend
    with pytest.raises(InvalidParameterError):
        select_attention_backend("cpu", "triton")
    # Where the triton package does not import, naming it is a typed error; CUDA's default is unchanged.
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.delitem(sys.modules, "asyncinfer.models.attention.triton_backend")
    monkeypatch.delitem(sys.modules, "asyncinfer.models.attention.triton_decode")
    with pytest.raises(InvalidParameterError):
        select_attention_backend("cuda", "triton")
    assert type(select_attention_backend("cuda")) is SdpaBackend


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", [name for name, spec in SPECS.items()
                                  if spec.head_dim == 128 or spec.window or spec.softcap or spec.kind == "backend"])
def test_cuda_triton_backend_matches_sdpa(name: str) -> None:
    """On the device, compiled: the same cases as the interpreter's (those with head_dim 128, a window or a
    soft cap, and every backend case), against SDPA on the device and the float64 reference."""
    check_on_device(SPECS[name], "cuda")


def check_on_device(spec: Spec, device: str) -> None:
    """The kernel (or the backend) on ``device`` against SDPA there and the float64 reference (on "cuda"
    compiled; on "cpu" only in a process started with TRITON_INTERPRET=1)."""
    case = make_case(spec, device=device)
    inputs = case.worker_input()
    if spec.kind == "kernel":
        out = paged_decode_attention(inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["block_tables"],
                                     inputs["context_lens"], inputs["scale"], window=spec.window, softcap=spec.softcap)
    else:
        backend = select_attention_backend("cuda", "triton")  # selecting touches no device
        assert isinstance(backend, TritonDecodeBackend)
        meta = backend.build_metadata(query_lens=inputs["query_lens"], context_lens=inputs["context_lens"],
                                      block_tables=inputs["block_tables"], slot_mapping=inputs["slot_mapping"],
                                      block_size=spec.block_size, device=device)
        out = backend.forward(case.q, case.k, case.v, (case.k_cache.clone(), case.v_cache.clone()), meta,
                              inputs["scale"], window=spec.window, softcap=spec.softcap)
    if device == "cuda":
        torch.cuda.synchronize()
    assert out.device.type == device and out.dtype == spec.dtype and torch.isfinite(out).all()
    tol = TOL[spec.dtype] if spec.dtype != torch.float32 else 5e-5  # TF32-free; the GPU's exp differs a little
    torch.testing.assert_close(out.double().cpu(), reference(case), atol=tol, rtol=tol)
    sdpa_tol = max(sdpa_tolerance(spec), 2 * tol)
    torch.testing.assert_close(out.double(), sdpa_output(case).double(), atol=sdpa_tol, rtol=sdpa_tol)
