"""The policy lab: replay request traces through real schedulers without running a model.

    from asyncinfer.lab import synthetic_trace, simulate, summarize

    trace = synthetic_trace(200, rate=1.5, seed=0)
    for name in ("fifo", "length-bucket", "aging-priority", "pd-split"):
        print(summarize(name, simulate(trace, name).records))

The command line is ``asyncinfer lab`` (``--help`` lists its options). Only
the calibration (``asyncinfer lab --calibrate``) runs the model, and it is
:mod:`asyncinfer.commands.calibrate`, above the engine: the lab never imports the engine.
"""

from asyncinfer.lab.cost import FEATURES, StepCostModel, StepShape, fit_cost_model, load_cost_model
from asyncinfer.lab.report import PolicySummary, Slo, format_table, percentile, save_plot, summarize
from asyncinfer.lab.simulator import (
    ContractViolation,
    RequestRecord,
    SimResult,
    StepRecord,
    check_schedule,
    simulate,
)
from asyncinfer.lab.trace import TraceRequest, load_trace, save_trace, synthetic_trace

__all__ = [
    "FEATURES",
    "ContractViolation",
    "PolicySummary",
    "RequestRecord",
    "SimResult",
    "Slo",
    "StepCostModel",
    "StepRecord",
    "StepShape",
    "TraceRequest",
    "check_schedule",
    "fit_cost_model",
    "format_table",
    "load_cost_model",
    "load_trace",
    "percentile",
    "save_plot",
    "save_trace",
    "simulate",
    "summarize",
    "synthetic_trace",
]
