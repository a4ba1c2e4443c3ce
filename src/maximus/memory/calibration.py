"""The estimator calibrated by a measured probe: "first measure the peak on a small batch, then
pick the card".

`maximus plan --measure` runs a few real optimizer steps of the user's config at a small
micro-batch (`maximus.train.probe`), and compares the measured peak of each part with the
estimate of that same probe run:

* **static** (resident between steps): the measured parameters + optimizer state against the
  estimate's weights + adapters + optimizer;
* **dynamic** (what one step adds): the measured peak minus the static part, against the
  estimate's peak minus its static part.

`Calibration.peak(plan)` is then ``static x static_scale + dynamic x dynamic_scale`` of any other
plan of the same model (another micro-batch, another card): what the estimator gets right about
what stays, and what it gets right about what grows with the tokens, each corrected by its own
measured ratio. `fit_card` picks, per card, the fastest plan whose calibrated peak fits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from maximus.memory.plan import Plan

__all__ = ["Calibration", "STATIC_PARTS", "fit_card", "static_bytes"]

#: Parts of an estimate's breakdown that stay resident between steps.
STATIC_PARTS = ("weights", "adapters", "optimizer")


def static_bytes(breakdown) -> int:
    """The resident part (bytes) of an estimate's breakdown (`STATIC_PARTS`)."""
    return sum(int(breakdown.get(k, 0)) for k in STATIC_PARTS)


@dataclass(frozen=True)
class Calibration:
    """Measured / predicted ratios of a probe run (bytes as measured and as estimated)."""

    measured_peak: int
    predicted_peak: int
    measured_static: int
    predicted_static: int
    probe_tokens: int  #: tokens of the probe's largest micro-batch
    probe_micro_batch: int
    steps: int
    device: str = "cpu"  #: where the probe ran

    @property
    def static_scale(self) -> float:
        return self.measured_static / self.predicted_static if self.predicted_static else 1.0

    @property
    def dynamic_scale(self) -> float:
        predicted = self.predicted_peak - self.predicted_static
        measured = self.measured_peak - self.measured_static
        return measured / predicted if predicted > 0 and measured > 0 else 1.0

    @property
    def probe_error(self) -> float:
        """The uncalibrated estimate's error on the probe: predicted / measured - 1."""
        return self.predicted_peak / self.measured_peak - 1

    def peak(self, plan: Plan) -> int:
        """The calibrated peak of `plan` (bytes)."""
        static = static_bytes(plan.breakdown)
        return round(static * self.static_scale + (plan.peak_bytes - static) * self.dynamic_scale)

    def to_dict(self) -> dict[str, Any]:
        return {"measured_peak_bytes": self.measured_peak, "predicted_peak_bytes": self.predicted_peak,
                "measured_static_bytes": self.measured_static, "predicted_static_bytes": self.predicted_static,
                "static_scale": self.static_scale, "dynamic_scale": self.dynamic_scale,
                "probe_error": self.probe_error, "probe_tokens": self.probe_tokens,
                "probe_micro_batch": self.probe_micro_batch, "steps": self.steps, "device": self.device}


#: Planner budgets tried per card, as fractions of the card: the first (largest) whose plan's
#: calibrated peak fits the card with the margin wins.
_FRACTIONS = tuple(2.0 * 0.92 ** k for k in range(24))


def fit_card(memory_bytes: int, calibration: Calibration, plan_for: Callable[[int], Plan | None],
             margin: float) -> Plan | None:
    """The fastest plan for a card of `memory_bytes` whose calibrated peak fits it with `margin`:
    `plan_for(budget)` (the planner's plan for an estimate budget, None when nothing fits) is asked
    for budgets around the card (x2 down to x0.3), largest first. None: nothing fits."""
    usable = memory_bytes * (1 - margin)
    for fraction in _FRACTIONS:
        plan = plan_for(int(memory_bytes * fraction))
        if plan is not None and calibration.peak(plan) <= usable:
            return plan
    return None
