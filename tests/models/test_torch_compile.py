"""torch_compile=True: the decoder's element-wise chains compiled at load; the same tokens as eager,
no compilation while serving, and a clear error where torch.compile cannot run."""

from __future__ import annotations

import asyncio

import pytest
from torch._dynamo.utils import counters

from asyncinfer import AsyncEngine, ConfigurationError, InvalidParameterError, SamplingParams, loading
from asyncinfer.config import EngineConfig
from asyncinfer.models import torch_compile as compile_module
from asyncinfer.models.layers import EAGER_OPS, RMSNorm, SwiGLUMLP, apply_rope, rms_norm, silu_mul
from asyncinfer.models.loader import open_checkpoint

OPTIONS = {"dtype": "float32", "device": "cpu", "kv_cache_memory": 8 * 2**20, "max_model_len": 256}


async def serve(engine: AsyncEngine) -> list[list[int]]:
    prompts = [[5 + i, 9, 17 + 2 * i, 33] * (i + 1) for i in range(6)]  # one to 24 tokens: prefill and decode
    async with engine:
        outs = await asyncio.gather(*(engine.generate(p, SamplingParams(max_tokens=12, ignore_eos=True))
                                      for p in prompts))
    return [o.token_ids for o in outs]


async def test_compiled_decoder_serves_the_eager_tokens_without_compiling_again(tiny_models) -> None:
    path, _ = tiny_models["qwen2"]  # q/k/v bias and GQA
    eager = AsyncEngine.from_pretrained(path, **OPTIONS)
    compiled = AsyncEngine.from_pretrained(path, **OPTIONS, torch_compile=True)
    (info,) = compiled.model_info()
    assert info.compile_seconds is not None and info.compile_seconds > 0
    assert eager.model_info()[0].compile_seconds is None
    model = compiled._models.core(None).runner.model
    ops = model.ops  # the compiled record the model was built with
    assert (ops.rms_norm, ops.apply_rope, ops.silu_mul) != (rms_norm, apply_rope, silu_mul)
    assert eager._models.core(None).runner.model.ops is EAGER_OPS
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    mlps = [m for m in model.modules() if isinstance(m, SwiGLUMLP)]
    assert norms and all(m.fn is ops.rms_norm for m in norms)
    assert mlps and all(m.act_fn is ops.silu_mul for m in mlps)
    assert all(layer.attn.rope_fn is ops.apply_rope for layer in model.layers)
    graphs = counters["stats"]["unique_graphs"]
    assert await serve(compiled) == await serve(eager)
    assert counters["stats"]["unique_graphs"] == graphs  # the load compiled every shape the steps use


def test_torch_compile_is_a_bool(tiny_models) -> None:
    with pytest.raises(InvalidParameterError) as err:
        AsyncEngine.from_pretrained(tiny_models["llama"][0], **OPTIONS, torch_compile="yes")
    assert err.value.parameter == "torch_compile"


def test_a_machine_that_cannot_compile_fails_the_load_clearly(tiny_models, monkeypatch) -> None:
    def broken(fn, **kwargs):
        def run(*args):
            raise RuntimeError("InductorError: no working C++ compiler found\nmore detail")
        return run

    monkeypatch.setattr(compile_module.torch, "compile", broken)
    with pytest.raises(ConfigurationError) as err:
        AsyncEngine.from_pretrained(tiny_models["llama"][0], **OPTIONS, torch_compile=True)
    message = str(err.value)
    assert "torch_compile=True" in message and "no working C++ compiler found" in message
    assert "a C++ compiler" in message and "more detail" not in message


def _attributes(model) -> dict[str, dict[str, int]]:
    """Every submodule's own attributes (its ``vars()``, and its parameters, buffers and children by
    name), each as the identity of its value."""
    found = {}
    for name, module in model.named_modules():
        state = {key: id(value) for key, value in vars(module).items()}
        for table in ("_parameters", "_buffers", "_modules"):
            state.update({f"{table}.{key}": id(value) for key, value in getattr(module, table).items()})
        found[name] = state
    return found


def test_the_model_is_built_with_the_compiled_functions_and_nothing_patches_it(tiny_models) -> None:
    """torch_compile=True chooses the functions before the model exists: the loader builds the model with
    them, and the rest of the load (decode backend, runner) sets no attribute on any of the model's
    submodules. (The weight format's layer swap, quant.py's one documented change to a loaded model,
    is left out: float32 weights, not packed.)"""
    checkpoint = open_checkpoint(tiny_models["llama"][0])
    config = EngineConfig.from_options({**OPTIONS, "torch_compile": True, "pack_weights": False})
    assert config.quantization is None
    ops, seconds = compile_module.compile_elementwise_ops(checkpoint.config, config.device, config.dtype)
    assert seconds > 0
    loaded = checkpoint.load(config.dtype, config.device, ops=ops)
    model = loaded.model
    assert model.ops is ops
    assert all(m.fn is ops.rms_norm for m in model.modules() if isinstance(m, RMSNorm))
    before = _attributes(model)
    _, core = loading.build_core(loaded, config, compile_seconds=seconds)
    assert core.runner.model is model and core.runner.compile_seconds == seconds
    assert _attributes(model) == before
