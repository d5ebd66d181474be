"""Why decode steps run op by op: the load's log names the real reason a projection is not in a block format
(stranger28).

A GGUF file in a type no kernel takes (TQ1_0, IQ4_XS, ... written with the ``gguf`` package) loaded with the
default ``quantization`` (``"native"`` on it), or a projection whose input size is not a whole number of blocks,
was reported as ``layers.0.attn.qkv_proj is not in a block format (quantization_skip)``: an option the user had
not given, and which no value of fixes.

``benchmarks/quality.py --model``, which the load's warning on rounded weights and docs/formats.md send a user to,
ended in a traceback on such a file: ``ValueError: this tokenizer has no chat template`` (a base model, a file
make_gguf.py writes), then an ``IndexError`` past the rope table (the held-out text, 7,800 tokens, read whole into
a model of a shorter context); a model without a tokenizer was an ``AttributeError`` on None.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from asyncinfer import AsyncEngine, kernels
from benchmarks.make_gguf import SHAPES, write
from tests.helpers import REPO_ROOT, load_script, tiny_hf_model

OPTIONS = {"kv_cache_memory": 1 << 20, "max_model_len": 64, "num_threads": 1}


def _op_by_op_reason(caplog: pytest.LogCaptureFixture, model: Path, **options: object) -> str:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="asyncinfer"):
        AsyncEngine.from_pretrained(model, **OPTIONS, **options)
    lines = [r.getMessage() for r in caplog.records if "decode steps run op by op" in r.getMessage()]
    assert len(lines) == 1, caplog.text
    return lines[0]


def test_a_format_no_kernel_takes_is_named_not_quantization_skip(tmp_path, caplog) -> None:
    assert kernels.available(), kernels.unavailable_reason()
    path = tmp_path / "tiny_tq1_0.gguf"
    write(path, SHAPES["tiny"], "llama", "tq1_0", "q8_0", "none", 0)
    line = _op_by_op_reason(caplog, path)
    assert "quantization='native'" in line
    assert "layers.0.attn.qkv_proj is not in a block format (its file stores it as tq1_0, which no kernel takes)" in line
    assert "quantization_skip" not in line


def test_an_input_size_of_no_whole_blocks_is_named(tmp_path, caplog) -> None:
    assert kernels.available(), kernels.unavailable_reason()
    tiny_hf_model("llama", 0, intermediate_size=80).save_pretrained(tmp_path, safe_serialization=True)
    line = _op_by_op_reason(caplog, tmp_path, quantization="q4_1")
    assert "layers.0.mlp.down_proj is not in a block format (its input size, 80, is not a whole number of blocks)" in line
    assert "quantization_skip" not in line


def test_quantization_skip_is_named_where_it_is_the_reason(tmp_path, caplog) -> None:
    assert kernels.available(), kernels.unavailable_reason()
    tiny_hf_model("llama", 0).save_pretrained(tmp_path, safe_serialization=True)
    line = _op_by_op_reason(caplog, tmp_path, quantization="q4_1", quantization_skip=("o_proj",))
    assert "layers.0.attn.o_proj is not in a block format (quantization_skip names it)" in line


@pytest.fixture
def quality(monkeypatch):
    return load_script(monkeypatch, REPO_ROOT / "benchmarks" / "quality.py", "stranger28_quality")


def test_quality_prompts_are_plain_text_without_a_chat_template(tmp_path, quality, capsys) -> None:
    path = tmp_path / "tiny_llama.gguf"
    write(path, SHAPES["tiny"], "llama", "q8_0", "q8_0", "spm", 0)
    tokenizer = AsyncEngine.from_pretrained(path, **OPTIONS).get_tokenizer()
    prompts = quality.chat_prompts(tokenizer, 3)
    assert prompts == [tokenizer.encode(q, add_special_tokens=True) for q in quality.QUESTIONS[:3]]
    assert capsys.readouterr().out.count("no chat template to apply") == 1


def test_quality_reads_the_held_out_text_within_the_model_context(tmp_path, quality) -> None:
    path = tmp_path / "tiny_llama.gguf"
    write(path, SHAPES["tiny"], "llama", "q8_0", "q8_0", "spm", 0)
    tokenizer = AsyncEngine.from_pretrained(path, **OPTIONS).get_tokenizer()
    ref = quality.reference_inputs(tokenizer, str(path), 2, 512)
    assert len(ref["text"]) == 512 and len(ref["prompts"]) == 2
    with pytest.raises(SystemExit, match="has no tokenizer"):
        quality.reference_inputs(None, str(path), 2, 512)
