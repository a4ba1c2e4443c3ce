"""Logging sinks besides metrics.jsonl: TensorBoard, Weights & Biases, MLflow (`logging.*`).

Each sink gets, per optimizer step, every number of the metrics row (loss, lr, grad_norm,
tokens_per_s, memory_bytes, peak_memory_bytes, ...) plus ``budget_bytes`` when the run has a
budget, and the held-out metrics of the evaluations (``eval/...`` during training, and
``eval_before/...`` / ``eval_after/...`` around it).

- TensorBoard (``logging.tensorboard``): event files under ``<run dir>/tensorboard``
  (`torch.utils.tensorboard.SummaryWriter`).
- Weights & Biases (``logging.wandb``): ``wandb.init(dir=<run dir>)``; ``WANDB_MODE=offline``
  keeps the run under ``<run dir>/wandb/offline-run-*`` (``wandb sync`` uploads it later).
- MLflow (``logging.mlflow``): a run in ``logging.mlflow_uri``, by default a local SQLite store
  ``<run dir>/mlflow.db`` (``mlflow ui --backend-store-uri sqlite:///<run dir>/mlflow.db``).

A sink whose library is missing is a one-line `ConfigError` naming the extra to install, raised
by `open_sinks` before the first step.
"""
from __future__ import annotations

import math
import uuid
from pathlib import Path

from maximus.errors import ConfigError

EXTRAS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def _require(key: str, module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"logging.{key}: true needs the {EXTRAS[key]} package, which is not installed",
                          f'pip install "maximusllm[{EXTRAS[key]}]", or set logging.{key}: false') from None


def _numbers(values: dict, prefix: str = "") -> dict[str, float]:
    """The finite numbers of a metrics dict (bools, strings, lists and None left out)."""
    out = {}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        if key == "step":
            continue
        out[prefix + key] = float(value)
    return out


class TensorBoardSink:
    def __init__(self, run_dir: Path, resume_step: int):
        _require("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=resume_step + 1 if resume_step else None)

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, run_dir: Path, resume_step: int, config: dict):
        wandb = _require("wandb", "wandb")
        # The run id is kept in the run directory, so a resumed run continues the same W&B run;
        # a fresh start (no checkpoint to resume) is a new W&B run, as with MLflow.
        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() and resume_step else uuid.uuid4().hex[:8]
        id_file.write_text(run_id)
        self.run = wandb.init(project="maximus", name=run_dir.name, id=run_id, dir=str(run_dir), config=config,
                              resume="allow")

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflowSink:
    def __init__(self, run_dir: Path, resume_step: int, uri: str | None, config: dict):
        mlflow = _require("mlflow", "mlflow")
        uri = uri or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment("maximus")
        id_file = run_dir / "mlflow_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() and resume_step else None
        self.mlflow = mlflow
        self.run = mlflow.start_run(run_id=run_id, run_name=None if run_id else run_dir.name)
        id_file.write_text(self.run.info.run_id)
        if run_id is None:
            params = [(k, str(v)[:250]) for k, v in _flat(config).items()]
            for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                mlflow.log_params(dict(params[start:start + 100]))

    def log(self, values: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics({k.replace("@", "_at_"): v for k, v in values.items()}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def _flat(config: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class Sinks:
    """The configured sinks, written together (`step`, `eval`), closed together."""

    def __init__(self, sinks: list, budget_bytes: int | None):
        self.sinks = sinks
        self.budget_bytes = budget_bytes

    def __bool__(self) -> bool:
        return bool(self.sinks)

    def step(self, row: dict) -> None:
        """One metrics row: a training step, or an evaluation during training (``eval_*`` keys)."""
        step = int(row["step"])
        values = _numbers(row)
        if "loss" in row and self.budget_bytes:
            values["budget_bytes"] = float(self.budget_bytes)
        values = {("eval/" + k[len("eval_"):] if k.startswith("eval_") else k): v for k, v in values.items()}
        self._log(values, step)

    def eval(self, when: str, step: int, metrics: dict) -> None:
        """Held-out metrics ``before`` or ``after`` training, as ``eval_before/...``."""
        self._log(_numbers(metrics, prefix=f"eval_{when}/"), step)

    def _log(self, values: dict, step: int) -> None:
        if values:
            for sink in self.sinks:
                sink.log(values, step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def open_sinks(logging_cfg, run_dir: Path, *, resume_step: int = 0, budget_bytes: int | None = None,
               config: dict | None = None) -> Sinks:
    """The sinks `logging_cfg` asks for, opened on ``run_dir`` (raises ConfigError for a missing
    extra, before anything is written)."""
    wanted = [key for key in ("tensorboard", "wandb", "mlflow") if getattr(logging_cfg, key, False)]
    for key in wanted:  # every missing library is reported before any sink opens
        _require(key, key)
    config = config or {}
    sinks = []
    for key in wanted:
        if key == "tensorboard":
            sinks.append(TensorBoardSink(run_dir, resume_step))
        elif key == "wandb":
            sinks.append(WandbSink(run_dir, resume_step, config))
        else:
            sinks.append(MLflowSink(run_dir, resume_step, logging_cfg.mlflow_uri, config))
    return Sinks(sinks, budget_bytes)
