"""Adversarial pass 12 (in-process side): faults a hostile or careless caller sharing one engine could cause, found
and fixed."""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncinfer import AsyncEngine, InvalidParameterError, SamplingParams

BASE = {
    "kv_cache_memory": 4 * 1024 * 1024,
    "max_model_len": 512,
    "dtype": "float32",
    "device": "cpu",
    "block_size": 4,
    "num_threads": 1,
}
GOOD = [(29 * j) % 300 + 7 for j in range(9)]


@pytest.fixture(scope="module")
def llama(tiny_models):
    return tiny_models["llama"][0]


# ----------------------------------------------------------------- num_threads is bounded
def test_num_threads_past_max_threads_is_an_invalid_parameter_at_every_entry(llama, capsys) -> None:
    """``num_threads=20000`` was taken as it was and handed to ``torch.set_num_threads`` at the load, where OpenMP
    aborted the whole process (no exception to catch, every other caller's requests gone with it). It is bounded
    by ``MAX_THREADS`` (4096) now: an InvalidParameterError naming ``num_threads`` and the range, from the config,
    ``from_pretrained``, ``load``, an embedding model's options and the command line's ``--threads``; torch's
    thread count is left as it was."""
    from asyncinfer import cli
    from asyncinfer.config import MAX_THREADS, EngineConfig
    from asyncinfer.embedding import EmbeddingConfig

    assert MAX_THREADS == 4096
    before = torch.get_num_threads()
    for config in (EngineConfig, EmbeddingConfig):
        with pytest.raises(InvalidParameterError) as info:
            config(num_threads=20000)
        assert (info.value.parameter, info.value.value, info.value.allowed) == (
            "num_threads", 20000, "an integer in [1, 4096]")
        assert config(num_threads=MAX_THREADS).num_threads == MAX_THREADS  # the bound itself is taken
    with pytest.raises(InvalidParameterError) as info:
        AsyncEngine.from_pretrained(llama, **{**BASE, "num_threads": MAX_THREADS + 1})
    assert info.value.parameter == "num_threads"
    with pytest.raises(InvalidParameterError) as info:
        asyncio.run(AsyncEngine.load(llama, **{**BASE, "num_threads": 20000}))
    assert info.value.parameter == "num_threads"
    assert cli.main(["generate", str(llama), "--prompt", "x", "--threads", "20000"]) == 2
    assert "--threads 20000 is invalid: allowed an integer in [1, 4096]" in capsys.readouterr().err
    assert torch.get_num_threads() == before


# ----------------------------------------------------------------- remove_model retires draining versions too
@pytest.mark.parametrize("abort", [False, True], ids=["drain", "abort"])
async def test_remove_model_after_an_overlapping_swap_ends_the_old_versions_requests(llama, abort) -> None:
    """After an overlapping swap (the new version serving while the old one still drains requests),
    ``remove_model`` retired only the serving version and then stopped stepping the model: the requests on the
    draining old version never ended, their callers waiting forever. The removal retires every live version now,
    as it promises: their requests finish (``abort=False``) or end with ``finish_reason="abort"``
    (``abort=True``), and the model is gone."""
    long, short = SamplingParams(max_tokens=300, ignore_eos=True), SamplingParams(max_tokens=20, ignore_eos=True)
    async with AsyncEngine.from_pretrained(llama, **BASE) as engine:
        await engine.add_model("second", llama, **BASE)
        old = asyncio.ensure_future(engine.generate(GOOD, long, model="second"))
        while engine.step_stats("second").steps < 2:
            await asyncio.sleep(0.01)
        await engine.swap_model(llama, name="second")  # overlap: the old version drains `old`
        new = asyncio.ensure_future(engine.generate(GOOD, short, model="second"))  # ends first
        await asyncio.sleep(0)
        assert [i.state for i in engine.model_info() if i.name == "second"] == ["draining", "current"]
        await asyncio.wait_for(engine.remove_model("second", abort=abort), 60)
        outs = await asyncio.wait_for(asyncio.gather(old, new), 5)
        if abort:
            assert [o.finish_reason for o in outs] == ["abort", "abort"]
            assert len(outs[0].token_ids) < 300 and len(outs[1].token_ids) < 20
        else:
            assert [o.finish_reason for o in outs] == ["length", "length"]
            assert [len(o.token_ids) for o in outs] == [300, 20]
            assert outs[0].token_ids[:20] == outs[1].token_ids  # the same weights, greedy
        assert [i.name for i in engine.model_info()] == ["default"]
        assert len(engine._link.thread._holders) == 1
        out = await asyncio.wait_for(engine.generate(GOOD, SamplingParams(max_tokens=3)), 30)
        assert len(out.token_ids) == 3


# ----------------------------------------------------------------- `asyncinfer generate` goes through admission
def test_the_generate_command_runs_through_the_engines_admission_control(llama, tmp_path, capsys) -> None:
    """``asyncinfer generate`` runs its requests in-process through ``engine.generate``, so the engine's admission
    limits hold for it as for the API: with ``--max-num-seqs 1 --max-waiting-requests 0`` the requests sent beside
    the first one are refused. Such a refusal (``EngineOverloadedError``) used to end the whole job (exit status 2,
    the request already running aborted); it is that request's ``error`` now, in the flags' terms, and the job goes
    on (exit status 1). Within the limits every request runs."""
    import json

    from asyncinfer import cli

    prompts = tmp_path / "in.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": [5 + i, 6, 7, 8], "id": f"q{i}"}) + "\n" for i in range(3)))
    flags = ["--file", str(prompts), "--max-tokens", "4", "--ignore-eos", "--max-num-seqs", "1",
             "--kv-cache-memory", "4MiB", "--threads", "1", "--dtype", "float32", "--no-progress"]
    out = tmp_path / "out.jsonl"
    assert cli.main(["generate", str(llama), *flags, "--max-waiting-requests", "0", "--output", str(out)]) == 1
    first, *refused = [json.loads(line) for line in out.read_text().splitlines()]
    assert (first["id"], first["finish_reason"], first["completion_tokens"]) == ("q0", "length", 4)
    assert [r["id"] for r in refused] == ["q1", "q2"]
    for record in refused:
        assert set(record) == {"id", "error"}
        assert "(--max-num-seqs=1 + --max-waiting-requests=0)" in record["error"]
    assert "1 of 3 requests done" in capsys.readouterr().err
    assert cli.main(["generate", str(llama), *flags, "--max-waiting-requests", "2", "--output", str(out)]) == 0
    done = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["id"], r["completion_tokens"]) for r in done] == [("q0", 4), ("q1", 4), ("q2", 4)]
