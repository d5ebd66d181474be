"""Every load path plans memory from the config first and refuses, before reading a weight,
with one message naming the cause, the numbers and the fix."""

from __future__ import annotations

import json

import pytest

from asyncinfer import AsyncEngine, ConfigurationError
from asyncinfer.memory import GiB


@pytest.fixture
def llama_70b(tmp_path):
    """A directory with Llama-3-70B's config.json and no weights at all: reading one would fail."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
              "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
              "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
              "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_weights_that_cannot_fit_are_refused_before_loading_with_the_cause_and_the_fix(llama_70b) -> None:
    with pytest.raises(ConfigurationError) as err:
        AsyncEngine.from_pretrained(llama_70b, device="cpu", dtype="float32")
    message = str(err.value)
    assert message.startswith("the model does not fit: its weights need 262.8 GiB (float32) but ")
    assert "available on cpu; try a smaller model" in message  # no format fits here either (q4_1: 44.8 GiB)
    assert "kv_cache" not in message
    with pytest.raises(ConfigurationError) as err:
        AsyncEngine.plan_memory(llama_70b, available_bytes=200 * GiB, device="cpu", dtype="float32")
    assert str(err.value) == (
        "the model does not fit: its weights need 262.8 GiB (float32) but 200.0 GiB are available on cpu; "
        "try quantization='float16' (133.4 GiB of weights) or quantization='int8' (124.1 GiB of weights) "
        "or quantization='q8_0' (72.7 GiB of weights) or quantization='q4_1' (44.8 GiB of weights) "
        "or a smaller model")


async def test_add_model_names_the_weights_as_the_cause(llama_70b, tiny_models) -> None:
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], kv_cache_memory=1 << 20, max_model_len=64,
                                         device="cpu")
    async with engine:
        with pytest.raises(ConfigurationError) as err:
            await engine.add_model("big", llama_70b, available_bytes=21 * GiB)
        message = str(err.value)
        # The default format on a CPU: float16 weights (int8's 124.1 GiB does not fit either).
        assert "its weights need 133.4 GiB (float16 weights) but 21.0 GiB are available on cpu; try a smaller model" \
            in message
        assert "kv_cache_memory" not in message and "Lower" not in message
        with pytest.raises(ConfigurationError, match="weights need 133.4 GiB") as err:
            await engine.swap_model(llama_70b, available_bytes=21 * GiB)
        assert "mode='drain'" not in str(err.value)  # freeing the serving model would not make room either
        assert "does not fit: the model does not fit" not in str(err.value)
        assert [m.name for m in engine.model_info()] == ["default"]


async def test_a_drain_swap_that_can_never_fit_is_refused_before_draining(llama_70b, tiny_models) -> None:
    import asyncio

    from asyncinfer import SamplingParams

    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], kv_cache_memory=1 << 20, max_model_len=64,
                                         device="cpu")
    async with engine:
        before = engine.model_info()[0].version_id
        running = asyncio.create_task(engine.generate([5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True)))
        await asyncio.sleep(0.05)
        with pytest.raises(ConfigurationError) as err:
            await engine.swap_model(llama_70b, mode="drain", abort=True, available_bytes=21 * GiB)
        assert str(err.value).startswith("the new model does not fit beside the other loaded models, even with the "
                                         "serving version freed: its weights need 133.4 GiB (float16 weights)")
        out = await running
        assert out.finish_reason == "length" and len(out.token_ids) == 40  # never drained nor aborted
        assert engine.model_info()[0].version_id == before  # the serving version was never reloaded


async def test_drain_is_suggested_only_where_it_fits(tiny_models) -> None:
    MiB = 1 << 20
    options = {"kv_cache_memory": MiB, "max_model_len": 64, "device": "cpu", "activation_reserve": 64 * MiB}
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **options)
    async with engine:
        with pytest.raises(ConfigurationError) as err:  # one copy (~65 MiB) fits in 40 + the freed 65, not in 40
            await engine.swap_model(tiny_models["qwen2"][0], available_bytes=40 * MiB, **options)
        assert str(err.value).startswith("the new model does not fit beside the serving one: ")
        assert str(err.value).endswith("(swap with mode='drain', which frees the old one first, fits)")
        info = await engine.swap_model(tiny_models["qwen2"][0], mode="drain", available_bytes=40 * MiB, **options)
        assert info.version_id != 0 and info.source.endswith("tiny-qwen20")


def test_a_kv_budget_too_small_is_refused_before_the_weights_are_read(tiny_models, monkeypatch) -> None:
    from asyncinfer.models import loader

    def never(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr(loader.Checkpoint, "load", never)
    with pytest.raises(ConfigurationError, match="max_model_len=256 needs 16 blocks"):
        AsyncEngine.from_pretrained(tiny_models["llama"][0], kv_cache_memory=1024, max_model_len=256, device="cpu")


def test_engine_config_leaves_the_scheduler_to_load_and_plan_memory(tiny_models) -> None:
    """docs/api.md: EngineConfig does not resolve ``scheduler`` (a plugin registered later must work); load and
    plan_memory refuse an unknown one by name, before any weight is read; unknown keywords are named by
    from_options (a plain TypeError from the dataclass itself)."""
    from asyncinfer import EngineConfig, InvalidParameterError

    assert EngineConfig(scheduler="nope").scheduler == "nope"
    with pytest.raises(InvalidParameterError, match=r"^scheduler='nope' is invalid"):
        AsyncEngine.plan_memory(tiny_models["llama"][0], scheduler="nope", device="cpu")
    with pytest.raises(InvalidParameterError, match=r"^scheduler='nope' is invalid"):
        AsyncEngine.from_pretrained(tiny_models["llama"][0], scheduler="nope", device="cpu")
    with pytest.raises(InvalidParameterError, match=r"^bogus=1 is invalid: allowed a known option"):
        EngineConfig.from_options({"bogus": 1})
    with pytest.raises(TypeError, match="bogus"):
        EngineConfig(bogus=1)  # type: ignore[call-arg]
