"""The short version of benchmarks/load.py: Poisson traffic with cancellations and injected faults
on a tiny model; nothing lost, mixed, duplicated or leaked, and the engine serves after."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

LOAD = Path(__file__).resolve().parents[2] / "benchmarks" / "load.py"


def test_load_and_chaos_lose_nothing(tmp_path) -> None:
    spec = importlib.util.spec_from_file_location("load_benchmark", LOAD)
    assert spec is not None and spec.loader is not None
    load = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = load  # its dataclasses look their module up there
    spec.loader.exec_module(load)
    out = tmp_path / "load.json"
    code = load.main(["--tiny", "--num-requests", "50", "--rates", "20", "100", "--max-tokens", "4", "8", "16",
                      "--fault-rate", "0.01", "--cancel-fraction", "0.4", "--json", str(out)])
    record = json.loads(out.read_text())
    for result in record["results"]:
        counts = result["counts"]
        assert counts["lost"] == counts["wrong"] == counts["duplicated"] == counts["error"] == 0, result["examples"]
        assert counts["completed"] > 0 and result["blocks_leaked"] == 0 and result["requests_left"] == 0
        assert sum(counts[k] for k in ("completed", "cancelled", "failed")) == 50
    assert record["serves_after"] is True and code == 0
