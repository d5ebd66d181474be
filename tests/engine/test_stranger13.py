"""A thirteenth stranger's first hour with a model of their own and the benchmarks: what misled, each held to its
fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from asyncinfer import AsyncEngine
from tests.helpers import load_script

ROOT = Path(__file__).resolve().parents[2]


def _throughput(monkeypatch):
    return load_script(monkeypatch, ROOT / "benchmarks" / "throughput.py", "throughput_under_test")


def test_the_throughput_benchmark_checks_an_embedding_kept_in_its_blocks(tmp_path: Path, monkeypatch) -> None:
    """``benchmarks/throughput.py --model my.gguf`` printed "asyncinfer vs transformers weights, max |diff|: not
    checked (KeyError: 'embed_tokens.weight')" for every block-format GGUF (the default model's too): the embedding
    is kept in its file's blocks, with no float32 table. It is compared through its lookup now."""
    import torch

    model = tmp_path / "tiny.gguf"
    made = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "make_gguf.py"), str(model), "--shape", "tiny",
                           "--type", "q4_0", "--direct-blocks"], check=False, capture_output=True, text=True,
                          timeout=120)
    assert made.returncode == 0, made.stderr[-2000:]
    throughput = _throughput(monkeypatch)
    hf_model, _tokenizer = throughput.load_hf_reference(model, torch.float32)
    engine = AsyncEngine.from_pretrained(str(model), device="cpu")
    assert type(engine.core.runner.model.embed_tokens).__name__ == "BlockEmbedding"
    assert throughput.check_same_weights(engine, hf_model) == {"embed_tokens": 0.0, "layer0.input_norm": 0.0,
                                                               "norm": 0.0}
