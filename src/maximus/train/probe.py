"""The measured probe of `maximus plan --measure`: a few real optimizer steps of the user's run.

`run_probe(cfg)` trains the config as written (model, data, method, techniques) for ``steps``
optimizer steps of two micro-batches of ``micro_batch`` rows each (so accumulation is part of
the step) on the present device, without a budget, evaluation or sinks, in a temporary output
directory that is removed afterwards, and returns the `Calibration` of the estimator: the
measured peak and its resident part (parameters + optimizer state, `MemoryMeter.breakdown`)
against the plan's prediction for that same probe.
"""
from __future__ import annotations

import contextlib
import io
import tempfile
from pathlib import Path

from maximus.config import Config
from maximus.memory.calibration import Calibration, static_bytes

__all__ = ["run_probe", "probe_config"]


def probe_config(cfg: Config, output_dir: Path, *, steps: int = 3, micro_batch: int = 1) -> Config:
    """The run `cfg` cut to the probe: ``steps`` steps of 2 x ``micro_batch`` rows, row-count
    micro-batches, no budget, no evaluation, no checkpoints between steps, no sinks."""
    d = cfg.to_dict()
    d["output_dir"] = str(output_dir)
    d["training"] = {**d["training"], "max_steps": steps, "batch_size": 2 * micro_batch,
                     "micro_batch_size": micro_batch, "micro_batch_tokens": None, "save_every": None}
    d["optimization"] = {**d["optimization"], "target_vram": None}
    d["eval"] = {**d["eval"], "enabled": False}
    d["logging"] = {**d["logging"], "progress": "none", "tensorboard": False, "wandb": False, "mlflow": False}
    return Config.from_dict(d, source="maximus plan --measure")


def run_probe(cfg: Config, *, steps: int = 3, micro_batch: int = 1) -> Calibration:
    """Train the probe (`probe_config`) and calibrate the estimator with what it measured.

    Raises what `maximus-train` raises for this config (ConfigError, DataError, ModelError)."""
    from maximus.train.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="maximus-probe-") as tmp, contextlib.redirect_stdout(io.StringIO()):
        # the probe's own summary lines would break `maximus plan --json`; its run directory is removed
        summary = Trainer(probe_config(cfg, Path(tmp) / "run", steps=steps, micro_batch=micro_batch)).train()
    plan, memory = summary["plan"], summary["memory"]
    measured = memory["breakdown"]
    predicted_static = static_bytes(plan["breakdown"])
    return Calibration(measured_peak=int(memory["peak_bytes"]), predicted_peak=int(plan["peak_bytes"]),
                       measured_static=int(measured["parameters"] + measured["optimizer_state"]),
                       predicted_static=predicted_static,
                       probe_tokens=int(plan.get("micro_batch_tokens_max") or micro_batch * plan["seq_len"]),
                       probe_micro_batch=micro_batch, steps=steps, device=str(summary["device"]).split(":")[0])
