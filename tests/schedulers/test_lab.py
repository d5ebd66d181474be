"""The policy lab: traces, the cost model and its calibration, the simulator, the CLI."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from asyncinfer import InvalidParameterError
from asyncinfer.cli import main
from asyncinfer.lab import (
    FEATURES,
    ContractViolation,
    StepCostModel,
    StepShape,
    TraceRequest,
    fit_cost_model,
    load_cost_model,
    load_trace,
    save_trace,
    simulate,
    summarize,
    synthetic_trace,
)
from asyncinfer.schedulers import FIFOScheduler, SchedulerConfig, SchedulerOutput


def test_trace_round_trip_and_errors(tmp_path: Path) -> None:
    trace = synthetic_trace(50, rate=2.0, seed=3)
    assert trace == synthetic_trace(50, rate=2.0, seed=3) != synthetic_trace(50, rate=2.0, seed=4)
    assert [t.arrival for t in trace] == sorted(t.arrival for t in trace)
    path = tmp_path / "t.jsonl"
    save_trace(trace, path)
    assert load_trace(path) == trace
    path.write_text('{"arrival": 0, "prompt_len": 5, "output_len": 2}\n\n{"arrival": 1, "prompt_len": 0, "output_len": 2}\n')
    with pytest.raises(InvalidParameterError, match=r"t.jsonl:3"):
        load_trace(path)
    path.write_text('{"arrival": 1, "prompt_len": 5, "output_len": 2}\n{"arrival": 0, "prompt_len": 9, "output_len": 1}\n')
    assert [t.id for t in load_trace(path)] == ["r2", "r1"]  # sorted by arrival, ids from line numbers
    with pytest.raises(InvalidParameterError, match="rate"):
        synthetic_trace(5, rate=0)


def test_step_shape_follows_the_runner() -> None:
    # Two decodes (contexts 10 and 33: padded to 48 with blocks of 16), a first chunk and a last chunk.
    shape = StepShape.from_batch([(9, 1, 10), (32, 1, 33), (0, 8, 20), (8, 12, 20)], block_size=16)
    assert shape == StepShape(tokens=22, sampled=3, prefill_seqs=2, decode_keys=2 * 48, prefill_keys=8 * 8 + 12 * 20)


def test_fit_recovers_known_coefficients() -> None:
    true = StepCostModel({"const": 0.05, "tokens": 0.002, "sampled": 0.0005, "prefill_seqs": 0.003,
                          "decode_keys": 2e-5, "prefill_keys": 1e-6})
    rng = random.Random(0)
    shapes = [StepShape(rng.randrange(1, 600), rng.randrange(0, 64), rng.randrange(0, 8), rng.randrange(0, 60000),
                        rng.randrange(0, 300000)) for _ in range(40)]
    fitted = fit_cost_model(shapes, [true.cost(s) for s in shapes])
    for name in FEATURES:
        assert fitted.coefficients[name] == pytest.approx(true.coefficients[name], rel=1e-6, abs=1e-12)
    assert fitted.meta["fit_max_rel_error"] < 1e-9


def test_shipped_cost_model_says_where_it_came_from() -> None:
    model = load_cost_model()
    assert set(model.coefficients) == set(FEATURES) and all(v >= 0 for v in model.coefficients.values())
    assert model.meta["command"].startswith("asyncinfer lab --calibrate")
    assert model.meta["fit_samples"] == len(model.meta["samples"]) >= len(FEATURES)
    decode = model.cost(StepShape(1, 1, 0, 128, 0))
    assert 0.005 < decode < 1.0  # a batch-1 decode of a 135M model on a CPU


def test_calibration_times_the_real_runner(tiny_llama: Path) -> None:
    from asyncinfer import AsyncEngine
    from asyncinfer.commands.calibrate import default_cases, time_cases

    engine = AsyncEngine.from_pretrained(tiny_llama, kv_cache_memory=1 << 20, max_model_len=256, device="cpu",
                                         dtype="float32")
    cases = default_cases(max_context=256)
    timed = time_cases(engine.core.runner, engine.core.sampler, cases, repeats=1)
    assert len(timed) == len(cases) == 21 and all(t > 0 for _, t in timed)
    # Each timing is labelled with the shape of the step that ran (blocks of 16, max_model_len 256):
    shapes = [s for s, _ in timed]
    assert shapes[0] == StepShape(tokens=1, sampled=1, prefill_seqs=0, decode_keys=128, prefill_keys=0)  # 1 decode
    assert shapes[9] == StepShape(64, 64, 0, 64 * 256, 0)  # 64 decodes at context 256
    assert shapes[14] == StepShape(512, 1, 1, 0, 512 * 512)  # a whole 512-token prompt
    assert shapes[15] == StepShape(256, 0, 1, 0, 256 * 256)  # a first chunk: nothing sampled
    assert shapes[16] == StepShape(128, 1, 1, 0, 128 * 256)  # a last chunk after 128 cached tokens
    assert shapes[-2] == StepShape(16 + 128, 17, 1, 16 * 512, 128 * 128)  # decodes beside a prompt


def test_the_calibration_lives_above_the_engine() -> None:
    from asyncinfer.commands import calibrate as above
    from asyncinfer.lab import calibrate as grid

    assert above.default_cases is grid.default_cases
    for name in ("calibrate", "time_cases"):
        with pytest.warns(DeprecationWarning, match=rf"from asyncinfer.commands.calibrate import {name}"):
            assert getattr(grid, name) is getattr(above, name)  # the old `from asyncinfer.lab.calibrate import name`


def test_simulation_is_deterministic_and_complete() -> None:
    trace = synthetic_trace(60, rate=0.5, seed=1)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=4096)
    a = simulate(trace, "aging-priority", config=config, num_blocks=600)
    b = simulate(trace, "aging-priority", config=config, num_blocks=600)
    assert [r.token_times for r in a.records] == [r.token_times for r in b.records]
    assert all(len(r.token_times) == r.output_len and r.finish == r.token_times[-1] for r in a.records)
    assert sum(s.preempted for s in a.steps) > 0  # 600 blocks: memory pressure happened
    assert sum(r.preemptions for r in a.records) == sum(s.preempted for s in a.steps)  # the requests' own counts
    s = summarize("aging-priority", a.records)
    assert s.requests == 60 and s.output_tokens == sum(t.output_len for t in trace)
    assert s.ttft_p50 <= s.ttft_p99 and s.e2e_p50 <= s.e2e_p99 and s.wait_max <= max(r.ttft for r in a.records)


class OverBudget(FIFOScheduler):
    """Broken on purpose: asks for one token more than the budget allows."""

    def schedule(self) -> SchedulerOutput:
        out = super().schedule()
        if out.num_scheduled_tokens:
            rid = next(iter(out.num_scheduled_tokens))
            self.kv.allocate_slots(rid, self.requests[rid].num_tokens + 1)
            out.num_scheduled_tokens[rid] += self.config.max_num_batched_tokens
        return out


class Idle(FIFOScheduler):
    def schedule(self) -> SchedulerOutput:
        return SchedulerOutput()


@pytest.mark.parametrize("cls, match", [(OverBudget, "max_num_batched_tokens"), (Idle, "scheduled nothing")])
def test_contract_breaches_are_caught(cls, match: str) -> None:
    with pytest.raises(ContractViolation, match=match):
        simulate([TraceRequest("a", 0.0, 8, 4)], cls)


def test_bad_input_names_the_parameter() -> None:
    with pytest.raises(InvalidParameterError, match="trace"):
        simulate([TraceRequest("a", 0.0, 5000, 4)], "fifo")
    with pytest.raises(InvalidParameterError, match="prompt_len"):
        TraceRequest("a", 0.0, 0, 4)
    with pytest.raises(InvalidParameterError, match="coefficients"):
        StepCostModel({"flops": 1.0})


def test_lab_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png, figures, trace = tmp_path / "lab.png", tmp_path / "lab.json", tmp_path / "trace.jsonl"
    assert main(["lab", "--synthetic", "40", "--seed", "2", "--plot", str(png), "--json", str(figures),
                 "--save-trace", str(trace), "--option", "pd-split.prefill_budget=32"]) == 0
    out = capsys.readouterr().out
    for name in ("fifo", "length-bucket", "aging-priority", "pd-split", "TTFT p99", "goodput"):
        assert name in out
    assert json.loads(figures.read_text())["summaries"][0]["policy"] == "fifo"
    assert f"plot saved to {png}" in out  # matplotlib is a dev dependency: the plot must be there
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The saved trace replays to the same figures.
    assert main(["lab", "--trace", str(trace), "--schedulers", "fifo", "--plot", ""]) == 0
    fifo_row = next(line for line in out.splitlines() if line.startswith("fifo"))
    assert capsys.readouterr().out.splitlines()[-1].split() == fifo_row.split()


def test_lab_command_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lab", "--synthetic", "5", "--schedulers", "nope", "--plot", ""]) == 2
    assert "--schedulers 'nope' is invalid" in capsys.readouterr().err
    assert main(["lab", "--synthetic", "5", "--option", "pd-split", "--plot", ""]) == 2
    assert "--option" in capsys.readouterr().err
