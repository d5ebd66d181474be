"""Decode backends (asyncinfer.models.decode_backends): which one each weight format gets, the runner's one
output record, the kernel backend against the torch reference forward, and nothing attached to the model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from asyncinfer import AsyncEngine, InvalidParameterError, kernels
from asyncinfer.models import load_model
from asyncinfer.models.attention.sdpa import KernelDecodeSdpaBackend, SdpaBackend
from asyncinfer.models.decode_backends import (
    KernelDecode,
    ModelOutput,
    StepBatch,
    TorchDecode,
    kernel_decode_blocker,
    select_decode_backend,
)
from asyncinfer.models.quant import apply_weight_format
from asyncinfer.runner import ModelRunner
from tests.helpers import PagedRunner, tiny_hf_model

CPU = torch.device("cpu")
SRC = Path(__file__).resolve().parents[2] / "src" / "asyncinfer"


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny random llama (untied head), qwen2 (tied head, q/k/v bias), gemma2 and gemma3 (tied heads), saved as
    safetensors."""
    out = {}
    for kind, seed in (("llama", 0), ("qwen2", 1), ("gemma2", 2), ("gemma3", 3)):
        path = tmp_path_factory.mktemp(f"decode-{kind}")
        tiny_hf_model(kind, seed).save_pretrained(path, safe_serialization=True)
        out[kind] = path
    return out


def formatted(path: Path, method: str | None, skip: tuple[str, ...] = ()) -> torch.nn.Module:
    model = load_model(path, torch.float32, "cpu").model
    apply_weight_format(model, method, skip)
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma2", "gemma3"])
@pytest.mark.parametrize(("method", "skip", "decode", "attention"), [
    (None, (), TorchDecode, SdpaBackend),
    ("float16", (), TorchDecode, SdpaBackend),
    ("int8", (), TorchDecode, SdpaBackend),
    ("q8_0", (), KernelDecode, KernelDecodeSdpaBackend),
    ("q4_1", (), KernelDecode, KernelDecodeSdpaBackend),
    # A layer left in float32, or the head: the reference forward, decode attention still in the kernel.
    ("q4_1", ("layers.1.mlp.down_proj",), TorchDecode, KernelDecodeSdpaBackend),
    ("q4_1", ("lm_head",), TorchDecode, KernelDecodeSdpaBackend),
])
def test_each_weight_format_gets_its_decode_backend(tiny_dirs, kind, method, skip, decode, attention) -> None:
    assert kernels.available(), kernels.unavailable_reason()
    model = formatted(tiny_dirs[kind], method, skip)
    chosen = select_decode_backend(model, model.config, "cpu")
    assert type(chosen) is decode and type(chosen.attention) is attention
    assert chosen.model is model and chosen.device == CPU
    blocker = kernel_decode_blocker(model)
    assert (blocker is None) == (decode is KernelDecode)
    if skip:
        assert skip[0] in blocker
    if decode is TorchDecode:
        with pytest.raises(ValueError, match="KernelDecode cannot run this model"):
            KernelDecode(model, KernelDecodeSdpaBackend(), CPU)


def test_the_engine_holds_the_backend_its_format_chose(tiny_dirs) -> None:
    opts = {"kv_cache_memory": 2**22, "max_model_len": 128, "device": "cpu"}
    for method, expected in (("q4_1", KernelDecode), ("float16", TorchDecode)):
        runner = AsyncEngine.from_pretrained(tiny_dirs["llama"], **opts, quantization=method).core.runner
        assert type(runner.decode) is expected and runner.decode.model is runner.model
    other = formatted(tiny_dirs["llama"], None)
    with pytest.raises(InvalidParameterError) as err:
        ModelRunner(runner.model, runner.config, runner.spec, num_blocks=4,
                    decode=TorchDecode(other, SdpaBackend(), CPU))
    assert err.value.parameter == "decode"


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_the_kernel_backend_decodes_as_the_torch_reference_does(tiny_dirs, kind) -> None:
    """On a tiny random model in q4_1 (weights rounded to its blocks): the prefill through the reference,
    then eight decode steps of three sequences, each one kernel call, against the model's own forward op by op
    over a copy of the same cache: logits within float32 (and int16 activation) rounding, greedy tokens equal,
    the record's greedy ids each row's argmax."""
    model = formatted(tiny_dirs[kind], "q4_1")
    kernel = select_decode_backend(model, model.config, CPU)
    reference = TorchDecode(model, SdpaBackend(), CPU)
    assert type(kernel) is KernelDecode
    ours, theirs = PagedRunner(model, seed=3), PagedRunner(model, seed=3)  # the same blocks, the same stale data
    prompts = [[5, 6, 7, 8, 9], list(range(3, 30)), [11, 4]]
    work = [(i, p) for i, p in enumerate(prompts)]
    a = kernel.forward(ours.step_batch(work, last_only=True), ours.kv_caches)
    b = reference.forward(theirs.step_batch(work, last_only=True), theirs.kv_caches)
    assert a.greedy_ids is None and a.logits.shape == (3, model.config.vocab_size)
    torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=0)  # a prefill: the reference on both sides
    last = a.logits.argmax(dim=-1).tolist()
    for _ in range(8):
        step = [(i, [t]) for i, t in enumerate(last)]
        batch = ours.step_batch(step)
        assert batch.sampled_decodes_only
        a = kernel.forward(batch, ours.kv_caches)
        b = reference.forward(theirs.step_batch(step), theirs.kv_caches)
        assert type(a) is ModelOutput and type(a.greedy_ids) is list and b.greedy_ids is None
        torch.testing.assert_close(a.logits, b.logits, atol=1e-3, rtol=1e-3)
        assert a.greedy_ids == a.logits.argmax(dim=-1).tolist() == b.logits.argmax(dim=-1).tolist()
        last = a.greedy_ids
    # A step of decodes whose rows are not all sampled, and an empty step: the reference, no greedy ids.
    partial = ours.step_batch([(0, [last[0]]), (1, [last[1]])])
    partial.logits_indices = [1]
    out = kernel.forward(partial, ours.kv_caches)
    assert out.greedy_ids is None and out.logits.shape == (1, model.config.vocab_size)
    empty = kernel.forward(StepBatch([], [], [], [], [], [], []), ours.kv_caches)
    assert empty.greedy_ids is None and empty.logits.shape == (0, model.config.vocab_size)


def test_the_runner_returns_one_record(tiny_dirs) -> None:
    """``run``: the logits and, on the kernels' decode step, the greedy ids the core hands to the sampler."""
    from asyncinfer.request import Request
    from asyncinfer.sampling_params import SamplingParams

    engine = AsyncEngine.from_pretrained(tiny_dirs["llama"], kv_cache_memory=2**22, max_model_len=128, device="cpu",
                                         block_size=16, quantization="q4_1")
    runner = engine.core.runner
    request = Request("r", [5, 6, 7], SamplingParams(max_tokens=4), arrival_time=0.0)
    table = {"r": [3]}
    prefill = runner.run(runner.prepare([(request, 3)], table))
    assert type(prefill) is ModelOutput and prefill.greedy_ids is None and prefill.logits.shape[0] == 1
    request.num_computed_tokens = 3
    request.output_token_ids.append(int(prefill.logits[0].argmax()))  # as apply_step does
    decode = runner.run(runner.prepare([(request, 1)], table))
    assert decode.greedy_ids == decode.logits.argmax(dim=-1).tolist() and len(decode.greedy_ids) == 1
    torch.testing.assert_close(runner.execute(runner.prepare([], {})), decode.logits[:0])


# The attributes the one-call path was once attached through, and the probes that looked for them.
_REMOVED = re.compile(r"\b(fused_decode|fused_stack|norm_fn|native_decode|greedy_tokens|use_native_norms|"
                      r"fuse_decode_layers)\b|(get|has)attr\((self\.model|self\.backend|meta\.backend|backend|layer)\b"
                      r"|(get|has)attr\([^)]*\"(decode_packed|decode_logits)\"")


def test_nothing_attaches_kernel_objects_to_the_model(tiny_dirs) -> None:
    """After a load in q4_1 no module of the model holds a kernel object or a callable other than its own
    functions, and src names none of the attributes and probes the one-call path used to go through."""
    engine = AsyncEngine.from_pretrained(tiny_dirs["qwen2"], kv_cache_memory=2**22, max_model_len=128,
                                         device="cpu", quantization="q4_1")
    model = engine.core.runner.model
    for name, module in model.named_modules():
        for key, value in vars(module).items():
            assert not isinstance(value, (kernels.DecodeLayer, kernels.DecodeStack)), f"{name}.{key}"
            assert not (callable(value) and getattr(value, "__module__", "").startswith("asyncinfer.kernels")), \
                f"{name}.{key}"
    found = [f"{path.relative_to(SRC)}:{n}: {line.strip()}" for path in SRC.rglob("*.py")
             if "kernels" not in path.relative_to(SRC).parts
             for n, line in enumerate(path.read_text().splitlines(), 1) if _REMOVED.search(line)]
    assert found == []
