"""Per-policy figures from request timelines, a text table, and an optional plot."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from asyncinfer.errors import InvalidParameterError
from asyncinfer.lab.simulator import RequestRecord


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (``q`` in [0, 100]); NaN for no values."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Slo:
    """A request meets the SLO when its TTFT and its TPOT are both within these seconds."""

    ttft: float = 2.0
    tpot: float = 0.25

    def __post_init__(self) -> None:
        # A NaN or a bound <= 0 was taken, and the table said "0% met" for every policy, with no word of why.
        for name, value in (("slo_ttft", self.ttft), ("slo_tpot", self.tpot)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise InvalidParameterError(name, value, "seconds > 0 (inf: no bound)")

    def met(self, r: RequestRecord) -> bool:
        tpot = r.tpot
        return r.ttft <= self.ttft and (tpot is None or tpot <= self.tpot)


@dataclass(frozen=True)
class PolicySummary:
    """One policy's figures over a replay; times in seconds."""

    policy: str
    requests: int
    output_tokens: int
    makespan: float
    throughput: float  # output tokens per second over the makespan
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    e2e_mean: float
    e2e_p50: float
    e2e_p99: float
    itl_max: float
    wait_max: float
    urgent_ttft_p50: float  # requests of the most urgent priority in the trace
    goodput: float  # requests meeting the SLO per second
    slo_attained: float  # fraction of requests meeting the SLO
    preemptions: int

    def to_dict(self) -> dict[str, Any]:
        """The figures; one with nothing to measure it by (NaN: TPOT where no request had two tokens) is None,
        JSON's null (``json.dump`` wrote ``NaN``, which strict JSON readers refuse)."""
        return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in asdict(self).items()}


def summarize(policy: str, records: Sequence[RequestRecord], slo: Slo = Slo(),
              wait_known: bool = True) -> PolicySummary:
    """Figures of finished ``records``. ``wait_known=False`` (a real engine) uses TTFT for the wait."""
    if not records:
        raise InvalidParameterError("records", [], "at least one request's record")
    start = min(r.arrival for r in records)
    end = max(r.finish for r in records if r.finish is not None)
    makespan = end - start
    tokens = sum(len(r.token_times) for r in records)
    ttft = [r.ttft for r in records]
    tpot = [t for r in records if (t := r.tpot) is not None]
    e2e = [r.e2e for r in records]
    top = min(r.priority for r in records)
    urgent = [r.ttft for r in records if r.priority == top]
    good = sum(slo.met(r) for r in records)
    waits = [r.wait for r in records] if wait_known else ttft
    return PolicySummary(
        policy=policy,
        requests=len(records),
        output_tokens=tokens,
        makespan=makespan,
        throughput=tokens / makespan if makespan > 0 else float("nan"),
        ttft_p50=percentile(ttft, 50),
        ttft_p99=percentile(ttft, 99),
        tpot_p50=percentile(tpot, 50),
        tpot_p99=percentile(tpot, 99),
        e2e_mean=sum(e2e) / len(e2e),
        e2e_p50=percentile(e2e, 50),
        e2e_p99=percentile(e2e, 99),
        itl_max=max((g for r in records for g in r.itls), default=0.0),
        wait_max=max(waits),
        urgent_ttft_p50=percentile(urgent, 50),
        goodput=good / makespan if makespan > 0 else float("nan"),
        slo_attained=good / len(records),
        preemptions=sum(r.preemptions for r in records),
    )


_COLUMNS = (
    ("policy", "policy", "{}"),
    ("tok/s", "throughput", "{:.1f}"),
    ("TTFT p50", "ttft_p50", "{:.2f}"),
    ("TTFT p99", "ttft_p99", "{:.2f}"),
    ("TPOT p50", "tpot_p50", "{:.3f}"),
    ("TPOT p99", "tpot_p99", "{:.3f}"),
    ("e2e p50", "e2e_p50", "{:.2f}"),
    ("e2e p99", "e2e_p99", "{:.2f}"),
    ("urgent TTFT p50", "urgent_ttft_p50", "{:.2f}"),
    ("ITL max", "itl_max", "{:.2f}"),
    ("max wait", "wait_max", "{:.2f}"),
    ("goodput req/s", "goodput", "{:.3f}"),
    ("SLO met", "slo_attained", "{:.0%}"),
    ("preempt", "preemptions", "{}"),
)


_NONE = "-"


def _is_nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


def format_table(summaries: Sequence[PolicySummary]) -> str:
    """A fixed-width table, one row per policy (times in seconds); ``-`` where there was nothing to measure (TPOT
    with no request of two or more output tokens), and a line under the table saying so."""
    rows = [[h for h, _, _ in _COLUMNS]]
    for s in summaries:  # "-" for a figure with nothing to measure it by (it printed "nan")
        rows.append([_NONE if _is_nan(v := getattr(s, attr)) else fmt.format(v) for _, attr, fmt in _COLUMNS])
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    if any(_is_nan(s.tpot_p50) for s in summaries):
        lines.append("TPOT -: no request produced two or more output tokens (TPOT is the time per token after the "
                     "first)")
    return "\n".join(lines)


def save_plot(results: dict[str, Sequence[RequestRecord]], summaries: Sequence[PolicySummary],
              path: str | Path, title: str = "") -> bool:
    """Latency CDFs and throughput/goodput bars as a PNG. Returns ``False`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for name, records in results.items():
        for ax, values in ((axes[0][0], [r.ttft for r in records]), (axes[0][1], [r.e2e for r in records])):
            xs = sorted(values)
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
    for ax, what in ((axes[0][0], "TTFT"), (axes[0][1], "end-to-end latency")):
        ax.set_xlabel(f"{what} (s)")
        ax.set_ylabel("fraction of requests")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    names = [s.policy for s in summaries]
    axes[1][0].bar(names, [s.throughput for s in summaries], color="tab:blue")
    axes[1][0].set_ylabel("output tokens / s")
    axes[1][1].bar(names, [s.goodput for s in summaries], color="tab:green")
    axes[1][1].set_ylabel("goodput (requests within SLO / s)")
    for ax in axes[1]:
        ax.tick_params(axis="x", labelrotation=20)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title or "asyncinfer policy lab")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
