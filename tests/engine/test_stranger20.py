"""An operator's first day (stranger20): a swap to a sentence encoder says what it is."""

from __future__ import annotations

import pytest

from asyncinfer import AsyncEngine, SamplingParams, SwapError

OPTIONS = {"kv_cache_memory": 4 * 1024 * 1024, "max_model_len": 256, "dtype": "float32", "device": "cpu"}


@pytest.mark.parametrize("mode", ["overlap", "drain"])
async def test_swapping_a_generator_to_a_sentence_encoder_says_it_is_one(tiny_models, minilm_dir, mode) -> None:
    """examples/hot_swap.py all-MiniLM-L6-v2 said "unsupported model_type 'bert' ...; supported: llama, ...", as if
    the file were broken; it is an embedding model, which add_model serves beside the generators."""
    engine = await AsyncEngine.load(tiny_models["llama"][0], **OPTIONS)
    async with engine:
        with pytest.raises(SwapError) as caught:
            await engine.swap_model(minilm_dir, mode=mode)
        assert str(caught.value) == (
            f"cannot load {str(minilm_dir)!r}: it is a sentence encoder (an embedding model), not a generator: serve it "
            "beside the generators with add_model(name, model) (swap_model replaces a generator with a generator); "
            "the serving models are untouched")
        assert [v.version_id for v in engine.model_info()] == [0]
        out = await engine.generate([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(out.token_ids) == 3
