"""A model whose weights hold NaN (a tensor's bytes corrupted, say) is refused at its load: the warm-up reads its
first tokens' log-probabilities. It loaded, warmed up and served, every request generating token 0 to its length
(greedy sampling's pick among NaN logits) without a word; a swap to such a file replaced a good model."""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file

from asyncinfer import AsyncEngine, ModelLoadError, SamplingParams, SwapError
from tests.helpers import ENGINE_BASE


def _with_nan(src, dst, name: str):
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    tensors[name] = tensors[name].clone()
    tensors[name][0] = float("nan")
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("tensor", ["model.norm.weight", "model.layers.0.self_attn.q_proj.weight"])
def test_a_model_with_nan_weights_is_refused_at_its_load(tiny_models, tmp_path, tensor) -> None:
    path = _with_nan(tiny_models["llama"][0], tmp_path / "nan", tensor)
    with pytest.raises(ModelLoadError, match="the model's logits are not finite at warm-up"):
        AsyncEngine.from_pretrained(path, **ENGINE_BASE)


async def test_a_swap_to_nan_weights_is_refused_and_the_model_serves_on(tiny_models, tmp_path) -> None:
    good = tiny_models["llama"][0]
    bad = _with_nan(good, tmp_path / "nan", "model.norm.weight")
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    async with await AsyncEngine.load(good, **ENGINE_BASE) as engine:
        before = await engine.generate([5, 6, 7], params)
        with pytest.raises(SwapError, match="not finite"):
            await engine.swap_model(bad)
        after = await engine.generate([5, 6, 7], params)
    assert after.token_ids == before.token_ids and len(set(before.token_ids)) > 1
