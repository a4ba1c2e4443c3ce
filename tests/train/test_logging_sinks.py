"""`logging.tensorboard / wandb / mlflow`: one real training run writes all three, and each is
read back with its own library (TensorBoard's event reader, W&B's offline run file, MLflow's
client); a run resumed from a checkpoint continues its TensorBoard log without duplicating or
losing a step; a missing extra is a one-line error naming the pip command."""
from __future__ import annotations

import glob
import json
import struct
import sys

import pytest
from tiny import one_thread, tiny_config  # noqa: F401  (one_thread: a fixture, used through pytestmark)

from maximus import Config
from maximus.errors import ConfigError
from maximus.train.progress import read_metrics
from maximus.train.metric_loggers import open_sinks

pytestmark = pytest.mark.usefixtures("one_thread")

STEP_KEYS = ("loss", "lr", "tokens_per_s", "memory_bytes", "peak_memory_bytes", "budget_bytes")


def wandb_history(path: str) -> list[dict]:
    """The history rows of a W&B run file (a LevelDB-style log of protobuf `Record`s)."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, block, pending, rows = 7, 32768, b"", []
    raws = []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            raws.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            raws.append(pending + chunk)
    for raw in raws:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
    return rows


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory, tiny_model_dirs):
    from maximus.train.trainer import Trainer
    from tiny import write_prompt_completion

    root = tmp_path_factory.mktemp("sinks")
    data = write_prompt_completion(root / "data.jsonl")
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    cfg = tiny_config(tiny_model_dirs["llama"], data, root / "run",
                      logging={"progress": "none", "tensorboard": True, "wandb": True, "mlflow": True},
                      optimization={"gradient_checkpointing": "off", "target_vram": "4GB"},
                      eval={"split": 0.1, "before": True, "every": 2},
                      training={"memory_meter": "every_step"})  # every row carries memory
    try:
        Trainer(Config.from_dict(cfg)).train()
    finally:
        mp.undo()
    run = root / "run"
    steps = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    evals = [r for r in read_metrics(run / "metrics.jsonl") if "eval_loss" in r]
    summary = json.loads((run / "run.json").read_text())
    return run, steps, evals, summary


def test_tensorboard_events_read_back(logged_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, steps, evals, summary = logged_run
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    for key in STEP_KEYS:
        scalars = events.Scalars(key)
        want = [r[key] if key != "budget_bytes" else summary["memory"]["budget_bytes"] for r in steps]
        assert [e.step for e in scalars] == [r["step"] for r in steps] == [1, 2, 3, 4]
        assert [e.value for e in scalars] == pytest.approx(want, rel=1e-6), key  # float32 events
    assert [e.step for e in events.Scalars("eval/loss")] == [r["step"] for r in evals] == [2]
    assert [e.value for e in events.Scalars("eval/loss")] == pytest.approx([r["eval_loss"] for r in evals], rel=1e-6)
    assert events.Scalars("eval_before/loss")[0].value == pytest.approx(summary["eval"]["before"]["loss"], rel=1e-6)
    assert events.Scalars("eval_after/loss")[0].value == pytest.approx(summary["eval"]["after"]["loss"], rel=1e-6)


def test_wandb_offline_run_read_back(logged_run):
    run, steps, evals, summary = logged_run
    files = glob.glob(str(run / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1
    history = wandb_history(files[0])
    by_step: dict[int, dict] = {}
    for row in history:
        by_step.setdefault(row["_step"], {}).update(row)
    for r in steps:
        for key in STEP_KEYS[:-1]:
            assert by_step[r["step"]][key] == pytest.approx(r[key], rel=1e-6)
        assert by_step[r["step"]]["budget_bytes"] == summary["memory"]["budget_bytes"]
    assert by_step[0]["eval_before/loss"] == pytest.approx(summary["eval"]["before"]["loss"], rel=1e-6)
    assert by_step[steps[-1]["step"]]["eval_after/loss"] == pytest.approx(summary["eval"]["after"]["loss"], rel=1e-6)


def test_mlflow_local_store_read_back(logged_run):
    from mlflow.tracking import MlflowClient

    run, steps, evals, summary = logged_run
    client = MlflowClient(f"sqlite:///{run / 'mlflow.db'}")
    run_id = (run / "mlflow_run_id").read_text().strip()
    for key in STEP_KEYS[:-1]:
        got = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert [g[0] for g in got] == [r["step"] for r in steps]
        assert [g[1] for g in got] == pytest.approx([r[key] for r in steps], rel=1e-9), key
    assert client.get_run(run_id).data.params["training.seq_len"] == "64"
    assert client.get_run(run_id).info.status == "FINISHED"


def test_tensorboard_after_resume_has_each_step_once(tiny_llama, tmp_path):
    """A run dies in step 4 after logging step 3, with its last checkpoint at step 2; the re-run
    resumes at step 3. TensorBoard's reader then shows steps 1-6 once each (the first run's step
    3 is purged, not shown twice), with the values of metrics.jsonl."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tiny import write_prompt_completion

    from maximus.train.trainer import Trainer

    class Crash(Exception):
        pass

    def crash_in_step_4(trainer, step):
        if step == 4:
            raise Crash

    data = write_prompt_completion(tmp_path / "data.jsonl")
    run = tmp_path / "run"
    cfg = tiny_config(tiny_llama, data, run, training={"max_steps": 6, "save_every": 2},
                      logging={"progress": "none", "tensorboard": True}, eval={"enabled": False})
    with pytest.raises(Crash):
        Trainer(Config.from_dict(cfg), hooks={"after_backward": crash_in_step_4}).train()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002"]
    first, = sorted((run / "tensorboard").iterdir())
    logged = [e.step for e in EventFileLoader(str(first)).Load() if e.summary.value and e.summary.value[0].tag == "loss"]
    assert logged == [1, 2, 3]  # step 3 was written before the crash: the resume must drop it
    Trainer(Config.from_dict(cfg)).train()
    assert len(list((run / "tensorboard").iterdir())) == 2  # the first run's file is kept, not rewritten
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    steps = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "lr", "tokens_per_s"):
        scalars = events.Scalars(key)
        assert [e.step for e in scalars] == [1, 2, 3, 4, 5, 6], key
        assert [e.value for e in scalars] == pytest.approx([r[key] for r in steps], rel=1e-6), key


def test_mlflow_uri_override(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    cfg = Config.from_dict({"model": "m", "dataset": "d.jsonl", "logging": {"mlflow": True, "mlflow_uri": uri}})
    sinks = open_sinks(cfg.logging, tmp_path, budget_bytes=123)
    sinks.step({"step": 1, "loss": 2.5, "lr": 0.1, "skipped": True})
    sinks.close()
    client = MlflowClient(uri)
    run_id = (tmp_path / "mlflow_run_id").read_text().strip()
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == [(1, 2.5)]
    assert [m.value for m in client.get_metric_history(run_id, "budget_bytes")] == [123.0]
    assert not (tmp_path / "mlflow.db").exists()


@pytest.mark.parametrize("key,module", [("tensorboard", "tensorboard"), ("wandb", "wandb"), ("mlflow", "mlflow")])
def test_missing_extra_is_one_line(key, module, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # as if the package were not installed
    cfg = Config.from_dict({"model": "m", "dataset": "d.jsonl", "logging": {key: True}})
    with pytest.raises(ConfigError) as err:
        open_sinks(cfg.logging, tmp_path)
    assert str(err.value) == (f"logging.{key}: true needs the {module} package, which is not installed "
                              f'(hint: pip install "maximusllm[{module}]", or set logging.{key}: false)')


@pytest.mark.parametrize("resume_step, same_run", [(0, False), (5, True)])
def test_wandb_reuses_the_stored_run_id_only_when_resuming(tmp_path, monkeypatch, resume_step, same_run):
    """A fresh start in a directory with an old wandb_run_id is a new W&B run (MLflow does the same);
    a resumed one continues the stored run."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb_run_id").write_text("oldrun12")
    cfg = Config.from_dict({"model": "m", "dataset": "d.jsonl", "logging": {"wandb": True}})
    sinks = open_sinks(cfg.logging, tmp_path, resume_step=resume_step)
    run_id = sinks.sinks[0].run.id
    sinks.close()
    assert (run_id == "oldrun12") is same_run
    assert (tmp_path / "wandb_run_id").read_text() == run_id
