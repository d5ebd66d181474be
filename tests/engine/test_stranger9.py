"""A ninth stranger's first hour with the library: what misled, each held to its fix."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from asyncinfer import AsyncEngine, InvalidParameterError, ModelLoadError, SamplingParams, config, model_source
from asyncinfer.config import EngineConfig
from asyncinfer.planner import plan_deployment

BASE = {"kv_cache_memory": 4 * 1024 * 1024, "max_model_len": 256, "device": "cpu", "num_threads": 1}
ALLOWED = ("'auto', None, 'float16', 'int8', 'q4_1', 'q8_0', 'q4_0', 'q5_0', 'q5_1', 'q4_k', 'q5_k', 'q6_k' or "
           "'native' on CPU, with float32 activations ('bfloat16' is a CUDA format)")


# ------------------------------------------------------------------------- quantization as users spell it
@pytest.mark.parametrize(("typed", "meant"), [("Q4_1", "q4_1"), (" q8_0 ", "q8_0"), ("Q4_K", "q4_k"),
                                               ("INT8", "int8"), ("Float16", "float16"), ("NATIVE", "native"),
                                               ("None", None), ("none", None)])
def test_a_supported_format_is_taken_in_any_case(typed, meant) -> None:
    """``quantization="Q4_1"`` (as llama.cpp and the file names spell it) was refused; it is q4_1."""
    assert EngineConfig(quantization=typed, dtype="float32").quantization == meant


def test_auto_in_any_case_is_auto() -> None:
    assert EngineConfig(quantization="AUTO").quantization == EngineConfig().quantization


@pytest.mark.parametrize(("typed", "nearest"), [
    ("Q4_K_M", ("'q4_k' (llama.cpp's Q4_K_M/Q4_K_S mix Q4_K with Q6_K; q4_k is every projection in Q4_K, the head "
               "in Q6_K, and native keeps a Q4_K_M file's own mix)")),
    ("q4_k_m", ("'q4_k' (llama.cpp's Q4_K_M/Q4_K_S mix Q4_K with Q6_K; q4_k is every projection in Q4_K, the head "
               "in Q6_K, and native keeps a Q4_K_M file's own mix)")),
    ("Q5_K_S", ("'q5_k' (llama.cpp's Q5_K_M/Q5_K_S mix Q5_K with Q6_K; q5_k is every projection in Q5_K, the head "
               "in Q6_K, and native keeps such a file's own mix)")),
    ("gguf", "'native' (a GGUF file's own formats are quantization='native' (or 'auto', the default, on a CPU))"),
    ("int4", "'q4_0' (4-bit weights are the block formats q4_0 / q4_1 / q4_k (asyncinfer's CPU kernels))"),
    ("4-bit", "'q4_0' (4-bit weights are the block formats q4_0 / q4_1 / q4_k (asyncinfer's CPU kernels))"),
    ("fp16", "'float16' (16-bit float weights are float16 ('bfloat16' on CUDA))"),
    ("fp32", "'none' (float32 weights (the dtype's own) are quantization=None (--quantization none))"),
    ("q8", "'q8_0' (8-bit weights are q8_0 (llama.cpp's Q8_0 blocks) or int8 (per-channel))"),
    ("Q8_1", "'q8_0'"),
])
def test_an_unsupported_format_names_the_allowed_ones_and_the_nearest(typed, nearest) -> None:
    with pytest.raises(InvalidParameterError) as caught:
        EngineConfig(quantization=typed, dtype="float32")
    assert caught.value.parameter == "quantization" and caught.value.value == typed
    assert caught.value.allowed == f"{ALLOWED}; nearest: {nearest}"


def test_a_name_near_nothing_gets_the_list_alone() -> None:
    with pytest.raises(InvalidParameterError) as caught:
        EngineConfig(quantization="zzzzzz")
    assert caught.value.allowed == ALLOWED


def test_the_planner_takes_the_same_spellings(tiny_models) -> None:
    from asyncinfer.models.loader import read_model_config

    mc = read_model_config(tiny_models["llama"][0])
    plan = plan_deployment(mc, device="cpu", device_memory=8 * 2**30, quantization="Q8_0")
    assert plan.quantization == "q8_0"
    with pytest.raises(InvalidParameterError, match="nearest: 'q4_k'"):
        plan_deployment(mc, device="cpu", device_memory=8 * 2**30, quantization="Q4_K_M")


async def test_a_model_loads_with_the_format_spelt_in_capitals(tiny_models) -> None:
    path = tiny_models["llama"][0]
    async with await AsyncEngine.load(path, quantization="Q8_0", **BASE) as upper:
        got = await upper.generate([5, 6, 7], SamplingParams(max_tokens=4))
    async with await AsyncEngine.load(path, quantization="q8_0", **BASE) as lower:
        want = await lower.generate([5, 6, 7], SamplingParams(max_tokens=4))
    assert got.outputs[0].token_ids == want.outputs[0].token_ids and len(got.outputs[0].token_ids) == 4


# ------------------------------------------------------------------------- a slow half dtype on a CPU
@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(config, "_WARNED_SLOW_DTYPES", set())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_dtype_without_native_kernels_warns_once_with_the_faster_choice(fresh_warnings, monkeypatch, caplog,
                                                                            dtype) -> None:
    monkeypatch.setattr(config, "cpu_has_fast_matmul", lambda d: False)
    name = str(dtype).removeprefix("torch.")
    with caplog.at_level(logging.WARNING, logger="asyncinfer"):
        EngineConfig(dtype=name, quantization=None)
        EngineConfig(dtype=name, quantization=None)
    warned = [r for r in caplog.records if r.name == "asyncinfer" and "is slow on this CPU" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert warned[0].getMessage() == (
        f"dtype={name} is slow on this CPU (it has no native {name} matrix kernels, so each one is emulated): "
        "dtype='auto' (--dtype auto: float32 activations, the weights kept small by quantization='auto', float16 "
        "or the GGUF file's own blocks) is faster (docs/formats.md)")


def test_no_warning_where_the_cpu_has_the_kernels_or_for_float32(fresh_warnings, monkeypatch, caplog) -> None:
    monkeypatch.setattr(config, "cpu_has_fast_matmul", lambda d: True)
    with caplog.at_level(logging.WARNING, logger="asyncinfer"):
        EngineConfig(dtype="bfloat16", quantization=None)
        EngineConfig(dtype="float32")
        EngineConfig()
    assert not [r for r in caplog.records if "is slow on this CPU" in r.getMessage()]


def test_the_check_reads_this_cpu() -> None:
    assert config.cpu_has_fast_matmul(torch.float16) is bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    assert config.cpu_has_fast_matmul(torch.bfloat16) is bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert config.cpu_has_fast_matmul(torch.float32) is True


# ------------------------------------------------------------------------- a Hugging Face Hub id
def _hub_cache(root: Path, repo_id: str, model_dir: Path, revision: str = "0123abcd") -> Path:
    """``model_dir`` laid out as huggingface_hub caches it: the files in ``blobs/`` by their hash, the snapshot's
    names symbolic links to them, ``refs/main`` naming the snapshot."""
    import hashlib
    import os

    repo = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for item in model_dir.iterdir():
        blob = repo / "blobs" / hashlib.sha256(item.read_bytes()).hexdigest()
        shutil.copy(item, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / item.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision + "\n", encoding="utf-8")
    return snapshot


async def test_a_hub_id_loads_from_the_local_hugging_face_cache(tiny_models, tmp_path, monkeypatch) -> None:
    """``AsyncEngine.load("HuggingFaceTB/SmolLM2-135M-Instruct")`` said the *path* did not exist, though the
    model sat in ~/.cache/huggingface from an earlier transformers run: a Hub id is now looked up there (refs/main's
    snapshot), and nowhere else."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    snapshot = _hub_cache(tmp_path / "hub", "tiny-org/Tiny-Llama-1", tiny_models["llama"][0])
    assert model_source.resolve_model("tiny-org/Tiny-Llama-1") == snapshot
    async with await AsyncEngine.load("tiny-org/Tiny-Llama-1", dtype="float32", **BASE) as engine:
        out = await engine.generate([5, 6, 7], SamplingParams(max_tokens=3))
    assert len(out.outputs[0].token_ids) == 3


def test_a_hub_id_not_in_the_cache_says_how_to_fetch_it(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError) as caught:
        model_source.resolve_model("HuggingFaceTB/SmolLM2-360M-Instruct")
    assert str(caught.value) == (
        f"model 'HuggingFaceTB/SmolLM2-360M-Instruct' is neither a path here nor in the local Hugging Face cache "
        f"({tmp_path / 'hf' / 'hub'}): asyncinfer never downloads from the Hub; fetch it once with "
        "`huggingface-cli download HuggingFaceTB/SmolLM2-360M-Instruct` (or `hf download "
        "HuggingFaceTB/SmolLM2-360M-Instruct`), then give the same id, or give a model directory or a .gguf file")


def test_a_gguf_repo_in_the_cache_gives_its_one_file_and_several_are_named(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    snapshot = tmp_path / "models--org--M-GGUF" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "m.Q4_0.gguf").write_bytes(b"GGUF")
    assert model_source.hub_cache_path("org/M-GGUF") == snapshot / "m.Q4_0.gguf"  # no refs/main: the snapshot there
    (snapshot / "m.Q8_0.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match=r"holds 2 \.gguf files .*give the one to load as the model path"):
        model_source.hub_cache_path("org/M-GGUF")


@pytest.mark.parametrize(("text", "hub"), [("HuggingFaceTB/SmolLM2-135M-Instruct", True), ("org/m.v2", True),
                                           ("a/b/c", False), ("./model", False), ("/abs/path", False),
                                           ("../x", False), ("org/..", False), ("no-slash", False),
                                           ("what is/this", False), ("~/models", False)])
def test_what_reads_as_a_hub_id(text, hub) -> None:
    assert model_source.is_hub_id(text) is hub


def test_a_missing_relative_path_is_still_named_as_a_path(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError, match=r"^model path 'models/x/y' does not exist"):
        model_source.resolve_model("models/x/y")


# ------------------------------------------------------------------------- dtype and device as users spell them
@pytest.mark.parametrize(("typed", "meant"), [("FP32", torch.float32), ("F32", torch.float32), (" Float32 ", torch.float32),
                                               ("torch.Float32", torch.float32)])
def test_a_dtype_in_any_case_is_taken(typed, meant) -> None:
    """``--dtype FP32`` was refused while ``fp32`` was taken."""
    assert EngineConfig(dtype=typed, quantization=None).dtype == meant


def test_auto_in_capitals_still_picks_the_files_own_format(tiny_models) -> None:
    """``dtype="AUTO"`` passed the dtype check but not the format's choice, which then fell back to float32
    weights (513 MiB for the default model instead of its 92 MiB of Q4_1 blocks)."""
    from asyncinfer.models.loader import read_model_config

    mc = read_model_config(tiny_models["llama"][0])
    upper = plan_deployment(mc, device="cpu", device_memory=8 * 2**30, dtype="AUTO")
    lower = plan_deployment(mc, device="cpu", device_memory=8 * 2**30, dtype="auto")
    assert (upper.quantization, upper.dtype) == (lower.quantization, lower.dtype)
    assert config.for_model(EngineConfig(dtype="AUTO"), {"dtype": "AUTO"}, mc).quantization == \
        config.for_model(EngineConfig(), {}, mc).quantization


@pytest.mark.parametrize("device", ["gpu", "mps", "GPU:0", "xpu"])
def test_a_gpu_of_another_name_says_cuda(device) -> None:
    with pytest.raises(InvalidParameterError) as caught:
        EngineConfig(device=device)
    assert caught.value.parameter == "device"
    assert caught.value.allowed == ("'cpu', 'cuda', 'cuda:N' or 'auto' (a GPU is 'cuda', an NVIDIA GPU: asyncinfer "
                                    "runs on no other kind)")


def test_another_bad_device_gets_the_list_alone() -> None:
    with pytest.raises(InvalidParameterError) as caught:
        EngineConfig(device="tpu2")
    assert caught.value.allowed == "'cpu', 'cuda', 'cuda:N' or 'auto'"


# ------------------------------------------------------------------------- other libraries' keywords
@pytest.mark.parametrize(("key", "hint"), [
    ("torch_dtype", "; torch_dtype is another library's name: asyncinfer's is dtype"),
    ("n_ctx", "; n_ctx is another library's name: asyncinfer's is max_model_len"),
    ("n_threads", "; n_threads is another library's name: asyncinfer's is num_threads"),
    ("gpu_memory_utilization", "; gpu_memory_utilization is another library's name: asyncinfer's is kv_cache_fraction"),
    ("tensor_parallel_size", ("; tensor_parallel_size has no asyncinfer option: asyncinfer runs a model on one device "
                             "(replicas on several: docs/scale_out.md)")),
    ("max_modle_len", "; did you mean max_model_len?"),
    ("bogus", ""),
])
def test_an_unknown_option_from_another_library_names_asyncinfers(key, hint) -> None:
    """``from_pretrained(path, torch_dtype=...)`` (transformers) or ``n_ctx=`` (llama-cpp-python) got the list of
    27 options and no word of which one was meant."""
    with pytest.raises(InvalidParameterError) as caught:
        EngineConfig.from_options({key: 1})
    assert caught.value.parameter == key
    assert caught.value.allowed.startswith("a known option: ['activation_dtype', ")
    assert caught.value.allowed.endswith("'torch_compile']" + hint)
