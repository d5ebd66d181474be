"""Gemma 2, Gemma 3 (text) and sliding-window attention, model by model against transformers (issue 23, item 3).

Tiny random models made from the families' config classes (tests/helpers.py: ``gemma2``, ``gemma3``,
``mistral_window``, ``qwen2_window``, ``qwen3_window``, each with a window of ``TINY_WINDOW`` tokens) are saved as
safetensors or written as llama.cpp lays out a GGUF, loaded by asyncinfer, and run over a shuffled paged
cache in prefill chunks, decodes and mixed steps, on prompts well past the window: every position's
logits equal transformers' full, uncached forward. In the block formats Gemma's decodes run on the kernels'
one-call step (``KernelDecode``), within its window and past it: greedy tokens equal the torch reference's
(``TorchDecode``), logits within a stated tolerance.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3Config, Gemma3TextConfig

from asyncinfer import kernels
from asyncinfer.errors import ModelLoadError
from asyncinfer.models import ModelConfig, load_model
from asyncinfer.models.attention.sdpa import KernelDecodeSdpaBackend, SdpaBackend
from asyncinfer.models.decode_backends import KernelDecode, TorchDecode, kernel_decode_blocker, select_decode_backend
from asyncinfer.models.gguf_file import GGUFFile
from asyncinfer.models.loader import gguf_model_config, open_checkpoint
from asyncinfer.models.quant import apply_weight_format
from tests.helpers import TINY_WINDOW, PagedRunner, hf_logits, tiny_hf_config, tiny_hf_model, write_gemma_gguf

WINDOWED = ["gemma2", "gemma3", "mistral_window", "qwen2_window", "qwen3_window"]
ATOL = 2e-4  # float32 on any CPU: the same sums in another order


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """kind -> (hf_model, saved directory), made once per module."""
    cache: dict[str, tuple[torch.nn.Module, Path]] = {}

    def make(kind: str) -> tuple[torch.nn.Module, Path]:
        if kind not in cache:
            hf = tiny_hf_model(kind, seed=7)
            path = tmp_path_factory.mktemp(f"tiny-{kind}")
            hf.save_pretrained(path, safe_serialization=True)
            cache[kind] = (hf, path)
        return cache[kind]

    return make


def run_in_steps(model: torch.nn.Module, tokens: list[int], backend=None) -> torch.Tensor:
    """Logits of every position of ``tokens`` [len, vocab]: a 13-token prefill, a 5-token chunk on
    its cached prefix, then one decode a token; a second sequence shares the decode steps (a mixed step
    first: its prefill beside our decode), so decodes of different lengths share a batch."""
    runner = PagedRunner(model, num_blocks=48, block_size=4, backend=backend)
    other = list(reversed(tokens))
    rows = runner.step([(0, tokens[:13])]) + runner.step([(0, tokens[13:18])])
    (mine, _) = runner.step([(0, tokens[18:19]), (1, other[:11])])
    rows.append(mine)
    for j in range(19, len(tokens)):
        (mine, _) = runner.step([(0, tokens[j : j + 1]), (1, other[j - 8 : j - 7])])
        rows.append(mine)
    return torch.cat(rows)


@pytest.mark.parametrize("kind", WINDOWED)
def test_logits_match_transformers_past_the_window(kind, saved) -> None:
    hf, path = saved(kind)
    loaded = load_model(path, torch.float32, "cpu")
    assert loaded.config.sliding_window == TINY_WINDOW
    assert loaded.config.max_position_embeddings == 256  # the model's context, not the window
    tokens = [int(t) for t in torch.randint(3, 256, (30,), generator=torch.Generator().manual_seed(1))]
    expected = hf_logits(hf, tokens)
    got = run_in_steps(loaded.model, tokens)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()
    # With the window ignored the logits past it are not these (the window really is applied).
    assert not torch.allclose(got[TINY_WINDOW + 2 :], _full_attention_logits(kind, path, tokens)[TINY_WINDOW + 2 :],
                              atol=1e-3)


def _full_attention_logits(kind: str, path: Path, tokens: list[int]) -> torch.Tensor:
    checkpoint = open_checkpoint(path)
    checkpoint.config = replace(checkpoint.config, sliding_window=None)
    model = checkpoint.load(torch.float32, "cpu", progress=lambda done, total: None).model
    return run_in_steps(model, tokens)


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_the_kernel_attention_backend_masks_what_the_kernel_cannot(kind, saved) -> None:
    """Decodes past the window or with soft-capped scores leave the kernel for the masked torch path."""
    from asyncinfer import kernels

    assert kernels.available(), kernels.unavailable_reason()
    hf, path = saved(kind)
    loaded = load_model(path, torch.float32, "cpu")
    tokens = [int(t) for t in torch.randint(3, 256, (26,), generator=torch.Generator().manual_seed(2))]
    got = run_in_steps(loaded.model, tokens, backend=KernelDecodeSdpaBackend())
    torch.testing.assert_close(got, hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_gemma_configs_normalise() -> None:
    g2 = ModelConfig.from_hf_config(tiny_hf_config("gemma2"))
    assert (g2.architecture, g2.head_dim, g2.query_pre_attn_scalar, g2.attention_scale) == ("gemma2", 16, 24, 24**-0.5)
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping, g2.norm_weight_offset) == (2.0, 4.0, 1.0)
    assert g2.layer_types == ("sliding_attention", "full_attention") and g2.sliding_rope_theta is None
    assert [g2.layer_window(i) for i in range(2)] == [TINY_WINDOW, None]
    g3 = ModelConfig.from_hf_config(tiny_hf_config("gemma3"))
    assert g3.architecture == "gemma3" and g3.tie_word_embeddings
    assert (g3.rope_theta, g3.rope_scaling, g3.sliding_rope_theta) == (1e6, {"rope_type": "linear", "factor": 2.0}, 1e4)
    assert [g3.layer_window(i) for i in range(3)] == [TINY_WINDOW, None, TINY_WINDOW]
    assert g3.attn_logit_softcapping is None and g3.final_logit_softcapping is None


def test_a_window_no_longer_caps_the_context() -> None:
    mistral = ModelConfig.from_hf_config(tiny_hf_config("mistral_window", max_position_embeddings=8192))
    assert (mistral.max_position_embeddings, mistral.sliding_window, mistral.layer_types) == (8192, TINY_WINDOW, None)
    assert mistral.layer_window(1) == TINY_WINDOW
    qwen = ModelConfig.from_hf_config(tiny_hf_config("qwen2_window"))
    assert [qwen.layer_window(i) for i in range(2)] == [None, TINY_WINDOW]
    assert ModelConfig.from_hf_config(tiny_hf_config("qwen2")).sliding_window is None  # use_sliding_window=False


@pytest.mark.parametrize(("config", "message"), [
    (Gemma3Config(text_config=tiny_hf_config("gemma3").to_dict()), r"unsupported model_type 'gemma3': a multimodal"),
    (Gemma3TextConfig(**{**tiny_hf_config("gemma3").to_dict(), "hidden_activation": "gelu"}),
     r"unsupported hidden_act 'gelu' for gemma3; only 'gelu_pytorch_tanh'"),
    (tiny_hf_config("gemma2", attention_bias=True), "gemma2 with attention_bias=True is not supported"),
    (Gemma3TextConfig(**{**tiny_hf_config("gemma3").to_dict(), "rope_parameters": {
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
        "full_attention": {"rope_type": "default", "rope_theta": 1e6}}}), "rope scaling 'linear' on the sliding"),
])
def test_what_the_gemma_models_cannot_run_is_refused_by_name(config, message) -> None:
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_hf_config(config)


def test_a_multimodal_config_json_is_refused_from_its_names(tmp_path) -> None:
    """Before transformers parses it and before any weight: its text part's family is no licence."""
    Gemma3Config(text_config=tiny_hf_config("gemma3").to_dict()).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=r"unsupported model_type 'gemma3': a multimodal model"):
        load_model(tmp_path, torch.float32, "cpu")


# ---- The kernels' one-call decode step (KernelDecode) against the torch reference (TorchDecode) ------


def gemma_in_blocks(kind: str, saved, method: str, *, window: bool) -> torch.nn.Module:
    """The tiny ``kind`` loaded in float32, every projection and the head in ``method``'s blocks; without its window
    (``window=False``: every layer attends to its whole context, so long contexts decode on the kernel step)."""
    checkpoint = open_checkpoint(saved(kind)[1])
    if not window:
        checkpoint.config = replace(checkpoint.config, sliding_window=None)
    model = checkpoint.load(torch.float32, "cpu", progress=lambda done, total: None).model
    apply_weight_format(model, method, ())
    return model


PROMPTS = [[5, 6, 7, 8, 9], list(range(3, 30)), [11, 4], *([j + 3, 2 * j + 5, 7 * j % 250 + 3] for j in range(9))]


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
@pytest.mark.parametrize(("method", "batch", "atol"), [
    # Below PANEL_MIN_ROWS (9) rows the kernels' GEMM rounds its activations to int16 per block of 32, the
    # reference multiplies float32 by the same weights: their logits agree within that rounding.
    ("q4_1", 1, 2e-3), ("q4_1", 3, 2e-3), ("q8_0", 3, 2e-3),
    # From 9 rows on both multiply float32 activations in the avx2 and scalar variants (the panel): the same sums in
    # another order (float32 rounding); the AVX-512 variants' int16 tile rounds them to int16 there too, so the
    # logits agree within that rounding again (the test's atol becomes 2e-3 there).
    ("q4_1", 12, 5e-5),
])
def test_the_kernel_decode_step_runs_gemma_as_the_torch_reference_does(kind, method, batch, atol, saved) -> None:
    """Gemma 2 (soft-capped scores and logits, GeGLU, four offset norms a layer, scaled embeddings, its own
    attention scale) and Gemma 3 (q/k norms, its sliding layers' own rope tables) in block formats: a prefill
    through the reference on both sides, then eight greedy decode steps of ``batch`` sequences (contexts up to 37),
    each one kernel call, against the model's own forward over a copy of the same cache: logits within ``atol``
    (and as much relative), the greedy tokens equal token for token."""
    if batch >= kernels.PANEL_MIN_ROWS and kernels.int16_batched() == "tile":
        atol = 2e-3
    model = gemma_in_blocks(kind, saved, method, window=False)
    assert kernel_decode_blocker(model) is None
    kernel = select_decode_backend(model, model.config, "cpu")
    assert type(kernel) is KernelDecode and type(kernel.attention) is KernelDecodeSdpaBackend
    stack = kernel.stack
    assert stack.embed_scale == pytest.approx(model.config.hidden_size**0.5)
    assert stack.logit_softcap == (4.0 if kind == "gemma2" else None)
    assert stack.rope_tables == (2 if kind == "gemma3" else 1)
    assert [layer._rope_table for layer in stack.layers] == ([1, 0, 1] if kind == "gemma3" else [0, 0])
    reference = TorchDecode(model, SdpaBackend(), torch.device("cpu"))
    ours, theirs = PagedRunner(model, seed=3), PagedRunner(model, seed=3)
    work = list(enumerate(PROMPTS[:batch]))
    a = kernel.forward(ours.step_batch(work, last_only=True), ours.kv_caches)
    b = reference.forward(theirs.step_batch(work, last_only=True), theirs.kv_caches)
    torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=0)  # a prefill: the reference on both sides
    last = a.logits.argmax(dim=-1).tolist()
    for _ in range(8):
        step = [(i, [t]) for i, t in enumerate(last)]
        a = kernel.forward(ours.step_batch(step), ours.kv_caches)
        b = reference.forward(theirs.step_batch(step), theirs.kv_caches)
        assert a.greedy_ids is not None and b.greedy_ids is None  # the kernel step ran
        torch.testing.assert_close(a.logits, b.logits, atol=atol, rtol=atol)
        assert a.greedy_ids == a.logits.argmax(dim=-1).tolist() == b.logits.argmax(dim=-1).tolist()
        last = a.greedy_ids
    torch.testing.assert_close(ours.kv_caches[0][0], theirs.kv_caches[0][0], atol=atol, rtol=atol)


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
@pytest.mark.parametrize(("method", "batch", "atol"), [("q8_0", 2, 2e-3), ("q4_1", 12, 5e-5)])
def test_a_windowed_gemma_decodes_past_its_window_on_the_kernel_step(kind, method, batch, atol, saved) -> None:
    """With its sliding layers' window of TINY_WINDOW tokens (blocks of 4: windows that start inside a block):
    decodes from contexts within the window to three times past it, every step on the kernel step (each sliding
    layer attends to its last TINY_WINDOW keys, the full layers to everything), greedy, token for token as the
    reference's masked attention, logits within ``atol`` (see the test above)."""
    if batch >= kernels.PANEL_MIN_ROWS and kernels.int16_batched() == "tile":
        atol = 2e-3
    model = gemma_in_blocks(kind, saved, method, window=True)
    assert model.config.sliding_window == TINY_WINDOW
    kernel = select_decode_backend(model, model.config, "cpu")
    assert type(kernel) is KernelDecode
    windows = [layer.attn.window for layer in model.layers]
    assert windows == ([TINY_WINDOW, None] if kind == "gemma2" else [TINY_WINDOW, None, TINY_WINDOW])
    assert [layer._args["window"] for layer in kernel.stack.layers] == windows
    reference = TorchDecode(model, SdpaBackend(), torch.device("cpu"))
    ours, theirs = (PagedRunner(model, num_blocks=128, seed=4) for _ in range(2))
    work = [(i, [5 + i, 9, 14 + 2 * i][: 2 + i % 2]) for i in range(batch)]
    a = kernel.forward(ours.step_batch(work, last_only=True), ours.kv_caches)
    b = reference.forward(theirs.step_batch(work, last_only=True), theirs.kv_caches)
    last = a.logits.argmax(dim=-1).tolist()
    for _ in range(3 * TINY_WINDOW):
        step = [(i, [t]) for i, t in enumerate(last)]
        a = kernel.forward(ours.step_batch(step), ours.kv_caches)
        b = reference.forward(theirs.step_batch(step), theirs.kv_caches)
        assert a.greedy_ids is not None  # the kernel step, within the window and past it
        torch.testing.assert_close(a.logits, b.logits, atol=atol, rtol=atol)
        assert a.greedy_ids == b.logits.argmax(dim=-1).tolist()
        last = a.greedy_ids


# ---- GGUF, as llama.cpp's converter writes Gemma ---------------------------------------------------


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_a_gguf_laid_out_as_llama_cpp_does_loads_and_matches(kind, tmp_path) -> None:
    hf = tiny_hf_model(kind, seed=11)
    path = write_gemma_gguf(hf, tmp_path / f"{kind}.gguf")
    # transformers' own GGUF reader (which takes the 1 back off the norms) gets the HF weights back:
    # the names and the +1 are llama.cpp's, not only this project's weight map.
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    expected = dict(hf.named_parameters())
    for name, p in theirs.named_parameters():
        torch.testing.assert_close(p, expected[name], atol=1e-6, rtol=0, msg=name)

    config = gguf_model_config(GGUFFile(path))
    hf_config = ModelConfig.from_hf_config(hf.config)
    for field in ("architecture", "sliding_window", "layer_types", "attn_logit_softcapping", "final_logit_softcapping",
                  "sliding_rope_theta", "rope_theta", "rope_scaling", "head_dim", "tie_word_embeddings"):
        assert getattr(config, field) == getattr(hf_config, field), field
    assert config.query_pre_attn_scalar == pytest.approx(hf_config.query_pre_attn_scalar)
    assert config.norm_weight_offset == 0.0  # the file's norms carry the 1

    loaded = load_model(path, torch.float32, "cpu")
    tokens = [int(t) for t in torch.randint(3, 256, (24,), generator=torch.Generator().manual_seed(3))]
    torch.testing.assert_close(run_in_steps(loaded.model, tokens), hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_a_gemma_gguf_without_the_optional_keys_gets_llama_cpps_defaults(tmp_path) -> None:
    """No pattern, no scale, no swa base: Gemma 3's pattern of 6, head_dim, 10000 (and the 27B rule)."""
    for layers, expected_scalar in ((8, 16.0), (62, 64 / 4)):
        path = tmp_path / f"g3-{layers}.gguf"
        writer = gguf.GGUFWriter(str(path), "gemma3")
        for add, value in ((writer.add_block_count, layers), (writer.add_context_length, 512),
                           (writer.add_embedding_length, 64), (writer.add_feed_forward_length, 128),
                           (writer.add_head_count, 4), (writer.add_head_count_kv, 1), (writer.add_key_length, 16),
                           (writer.add_value_length, 16), (writer.add_sliding_window, 32), (writer.add_vocab_size, 300)):
            add(value)
        writer.add_layer_norm_rms_eps(1e-6)
        writer.add_rope_freq_base(1e6)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        config = gguf_model_config(GGUFFile(path))
        assert config.query_pre_attn_scalar == expected_scalar
        assert config.sliding_rope_theta == 10000.0 and config.sliding_window == 32
        assert [i for i in range(layers) if config.layer_window(i) is None] == list(range(5, layers, 6))


def test_a_gguf_pattern_that_disagrees_with_the_layers_is_refused(tmp_path) -> None:
    path = tmp_path / "bad.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma2")
    for add, value in ((writer.add_block_count, 4), (writer.add_context_length, 512), (writer.add_embedding_length, 64),
                       (writer.add_feed_forward_length, 128), (writer.add_head_count, 4), (writer.add_vocab_size, 300)):
        add(value)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_sliding_window(32)
    writer.add_sliding_window_pattern([True, False, True])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"sliding_window_pattern has 3 entries for 4 layers"):
        gguf_model_config(GGUFFile(path))


def test_the_eot_token_of_a_gemma_gguf_ends_generation(tmp_path) -> None:
    """llama.cpp ends Gemma's turns at ``<end_of_turn>``: a GGUF vocabulary holding it adds its id to the eos ids."""
    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma2")
    for add, value in ((writer.add_block_count, 2), (writer.add_context_length, 512), (writer.add_embedding_length, 64),
                       (writer.add_feed_forward_length, 128), (writer.add_head_count, 4)):
        add(value)
    writer.add_layer_norm_rms_eps(1e-6)
    tokens = ["<pad>", "<eos>", "<bos>", "a", "<start_of_turn>", "<end_of_turn>", "b"]
    writer.add_token_list(tokens)
    writer.add_eos_token_id(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = gguf_model_config(GGUFFile(path))
    assert config.eos_token_ids == (1, 5) and config.vocab_size == len(tokens)
    assert np.all([config.layer_window(i) is None for i in range(2)])  # no window in the file
