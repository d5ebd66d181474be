"""Two small leaks of a long-running engine (issue 10, item 6): an aborted request's held-back
text, and the step stats' batch-size list."""

from __future__ import annotations

import asyncinfer.core as core_module
from asyncinfer import AsyncEngine, SamplingParams
from asyncinfer.request import Request
from tests.helpers import CharTokenizer

BASE = {"kv_cache_memory": 4 * 1024 * 1024, "max_model_len": 128, "dtype": "float32", "device": "cpu"}
PROMPT = [5, 17, 99, 3, 250, 42, 8]


def test_an_abort_delivers_the_text_its_detokenizer_held_back(tiny_models, hf_greedy) -> None:
    path, hf = tiny_models["llama"]
    core = AsyncEngine.from_pretrained(path, **BASE).core
    core.tokenizer = CharTokenizer()
    expected = hf_greedy(hf, PROMPT, 3)
    tail = CharTokenizer().decode(expected[2:3])
    # A stop string that starts with the third token's character and never completes:
    # that character is held back while it could still be the start of it.
    params = SamplingParams(max_tokens=10, ignore_eos=True, stop=[tail + "\u0001"])
    request = Request("r", PROMPT, params, arrival_time=0.0)
    core.add_request(request)
    outputs = []
    while request.num_output_tokens < 3:
        outputs += core.step()
    assert not "".join(o.text for o in outputs).endswith(tail)  # held back
    final = core.abort_request("r")
    assert [(o.finish_reason, o.text) for o in final] == [("abort", tail)]
    assert request.output_token_ids == expected
    assert "".join(o.text for o in outputs + final) == CharTokenizer().decode(expected)


def test_step_stats_keep_the_batch_sizes_of_the_last_steps_only(tiny_models, monkeypatch) -> None:
    monkeypatch.setattr(core_module, "BATCH_SIZE_HISTORY", 4)
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **BASE)
    core = engine.core
    core.add_request(Request("a", PROMPT, SamplingParams(max_tokens=8, ignore_eos=True), arrival_time=0.0))
    core.add_request(Request("b", PROMPT[:4], SamplingParams(max_tokens=6, ignore_eos=True), arrival_time=0.0))
    while core.has_unfinished_requests():
        core.step()
    stats = engine.step_stats()  # the public snapshot: a list, a copy
    assert stats.batch_sizes == [2, 2, 1, 1] and isinstance(stats.batch_sizes, list)  # of [2] * 6 + [1] * 2
    assert stats.batch_sizes is not core.stats.batch_sizes
    assert (stats.steps, stats.scheduled_requests) == (8, 14)
