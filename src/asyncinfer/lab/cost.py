"""The step-cost model: seconds per engine step from the step's shape, linear in a few features.

The features follow what the runner does with a step (see ``asyncinfer.runner`` and
``asyncinfer.models.attention.sdpa``, the attention backend the cost model was timed on):

- ``const``: fixed cost of a step (Python, tensor set-up, kernel launches);
- ``tokens``: tokens in the flattened batch (every linear layer);
- ``sampled``: rows that reach the LM head and the sampler (decodes and last prompt chunks);
- ``prefill_seqs``: prefill chunks (one attention call per chunk per layer);
- ``decode_keys``: keys the batched decode attention computes: the decodes' contexts
  plus the SDPA backend's ``decode_padding`` (every decode padded to the longest one,
  rounded up to whole blocks: decodes x that length);
- ``prefill_keys``: sum over prefill chunks of query tokens x context tokens.

Fit it with :func:`fit_cost_model` on timings of the real runner
(:mod:`asyncinfer.commands.calibrate`); the fitted model of the default model on the
machine the project was developed on ships as ``cost_models/smollm2-135m-cpu.json``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from asyncinfer.errors import InvalidParameterError
from asyncinfer.models.attention.padding import pad_to_longest_block as sdpa_decode_padding  # plain Python, no torch

FEATURES: tuple[str, ...] = ("const", "tokens", "sampled", "prefill_seqs", "decode_keys", "prefill_keys")
DEFAULT_COST_MODEL = "smollm2-135m-cpu.json"


@dataclass(frozen=True)
class StepShape:
    """The cost-relevant figures of one step (see the module docstring).

    ``decode_padding`` is the padding ``decode_keys`` counts: the SDPA backend's own
    (plain-Python) function, as the shipped cost model was timed on that backend.
    """

    tokens: int
    sampled: int
    prefill_seqs: int
    decode_keys: int
    prefill_keys: int

    decode_padding = staticmethod(sdpa_decode_padding)

    @classmethod
    def from_batch(cls, batch: Iterable[tuple[int, int, int]], block_size: int) -> StepShape:
        """``batch``: ``(num_computed_tokens, num_new_tokens, num_tokens)`` of each scheduled request."""
        tokens = sampled = prefill_seqs = prefill_keys = 0
        decodes: list[int] = []  # each decode's context
        for computed, n, known in batch:
            context = computed + n
            tokens += n
            sampled += context == known
            if n == 1:
                decodes.append(context)
            else:
                prefill_seqs += 1
                prefill_keys += n * context
        decode_keys = sum(decodes) + cls.decode_padding(decodes, block_size)
        return cls(tokens, sampled, prefill_seqs, decode_keys, prefill_keys)

    def features(self) -> list[float]:
        return [1.0, self.tokens, self.sampled, self.prefill_seqs, self.decode_keys, self.prefill_keys]


@dataclass(frozen=True)
class StepCostModel:
    """``seconds = sum(coefficients[f] * feature f)``; ``meta`` records where the numbers came from."""

    coefficients: dict[str, float]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.coefficients) - set(FEATURES)
        if unknown:
            raise InvalidParameterError("coefficients", sorted(unknown), f"names among {FEATURES}")
        if any(not (math.isfinite(v) and v >= 0) for v in self.coefficients.values()):
            # a NaN or infinite one made every figure of the lab's table nan or inf
            raise InvalidParameterError("coefficients", self.coefficients, "non-negative finite numbers")

    def cost(self, shape: StepShape) -> float:
        return sum(self.coefficients.get(name, 0.0) * x for name, x in zip(FEATURES, shape.features()))

    def to_dict(self) -> dict[str, Any]:
        return {"coefficients": dict(self.coefficients), **self.meta}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")


def load_cost_model(path: str | Path | None = None) -> StepCostModel:
    """A cost model JSON (``{"coefficients": {...}, ...}``); ``None``: the one shipped with asyncinfer."""
    allowed = "a JSON object with a 'coefficients' object"
    try:
        if path is None:
            text = resources.files("asyncinfer.lab").joinpath("cost_models", DEFAULT_COST_MODEL).read_text("utf-8")
        else:
            text = Path(path).read_text(encoding="utf-8")
        data = json.loads(text)
    except UnicodeDecodeError as exc:  # (before ValueError: it is one)
        raise InvalidParameterError("cost_model", str(path), f"{allowed} (the file is not UTF-8 text)") from exc
    except ValueError as exc:
        raise InvalidParameterError("cost_model", str(path), f"{allowed} (not JSON: {exc})") from exc
    except RecursionError as exc:
        raise InvalidParameterError("cost_model", str(path),
                                    f"{allowed} (JSON nested deeper than Python's recursion limit)") from exc
    if not isinstance(data, dict) or not isinstance(data.get("coefficients"), dict):
        raise InvalidParameterError("cost_model", str(path), allowed)
    coefficients = data["coefficients"]
    for name, value in coefficients.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidParameterError("coefficients", {name: value}, "numbers (seconds per unit of each feature)")
    meta = {k: v for k, v in data.items() if k != "coefficients"}
    return StepCostModel({k: float(v) for k, v in coefficients.items()}, meta)


def fit_cost_model(
    shapes: Sequence[StepShape], seconds: Sequence[float], meta: dict[str, Any] | None = None
) -> StepCostModel:
    """Least squares on relative error, with every coefficient kept >= 0.

    Relative error, because step times span two orders of magnitude (a small
    decode against a long prefill) and the small ones matter as much. A feature
    whose free fit comes out negative is dropped and the rest refitted.
    """
    import numpy as np

    if len(shapes) != len(seconds) or len(shapes) < len(FEATURES):
        raise InvalidParameterError("shapes", len(shapes), f"at least {len(FEATURES)} timed shapes, one per time")
    x = np.array([s.features() for s in shapes], dtype=np.float64)
    y = np.array(seconds, dtype=np.float64)
    w = 1.0 / y
    active = list(range(len(FEATURES)))
    while True:
        # Scale columns so that features of very different magnitudes condition well.
        cols = x[:, active] * w[:, None]
        scale = np.maximum(np.abs(cols).max(axis=0), 1e-30)
        coef, *_ = np.linalg.lstsq(cols / scale, y * w, rcond=None)
        coef = coef / scale
        if (coef >= 0).all():
            break
        active.pop(int(np.argmin(coef)))
    full = dict.fromkeys(FEATURES, 0.0)
    for i, c in zip(active, coef):
        full[FEATURES[i]] = float(c)
    pred = x @ np.array([full[f] for f in FEATURES])
    rel = np.abs(pred - y) / y
    info = {"fit_samples": len(y), "fit_mean_rel_error": float(rel.mean()), "fit_max_rel_error": float(rel.max())}
    return StepCostModel(full, {**(meta or {}), **info})
