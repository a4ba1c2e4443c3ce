"""Nothing is lost: SIGKILL mid-run then re-running resumes to the bitwise-same adapter as an
uninterrupted run (LoRA dropout on, so the dropout RNG and the data order must be restored);
SIGTERM, SIGINT and SIGUSR1 checkpoint and exit 75, and the re-run resumes; non-finite steps are
skipped."""
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from maximus import Config, Trainer
from maximus.errors import CheckpointError
from maximus.train.trainer import TrainingError

from tiny import tiny_config

RUNNER = """
import sys, time
from maximus.train import trainer as t
orig = t.Trainer.__init__
def slow_init(self, cfg, **kw):
    orig(self, cfg, hooks={"after_backward": lambda tr, step: time.sleep(0.8)}, **kw)
t.Trainer.__init__ = slow_init
from maximus.cli import train_main
sys.exit(train_main(sys.argv[1:]))
"""

STEPS = 8


def _cfg(tiny_llama, pc_data, out):
    return tiny_config(tiny_llama, pc_data, out, training={"max_steps": STEPS, "save_every": 1, "keep_checkpoints": 2},
                       eval={"enabled": False}, lora={"dropout": 0.1})


def _start(cfg: dict, tmp_path: Path) -> subprocess.Popen:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-c", RUNNER, "--config", str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _wait_for(path: Path, proc: subprocess.Popen, timeout=240):
    t0 = time.time()
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.time() - t0 < timeout
        time.sleep(0.05)


def _adapter(run: Path):
    return load_file(str(run / "adapter" / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def uninterrupted(tiny_llama, tmp_path_factory):
    from tiny import write_prompt_completion

    tmp = tmp_path_factory.mktemp("ref")
    data = write_prompt_completion(tmp / "data.jsonl")
    Trainer(Config.from_dict(_cfg(tiny_llama, data, tmp / "run"))).train()
    return data, _adapter(tmp / "run")


def _assert_same(a, b):
    """Bitwise: on CPU with a fixed thread count (tests/conftest.py) a resumed run repeats every op."""
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_sigkill_then_rerun_equals_uninterrupted(tiny_llama, uninterrupted, tmp_path):
    data, reference = uninterrupted
    cfg = _cfg(tiny_llama, data, tmp_path / "run")
    proc = _start(cfg, tmp_path)
    _wait_for(tmp_path / "run" / "checkpoints" / "step-000001", proc)
    with pytest.raises(CheckpointError) as err:  # a second run on the same output_dir refuses
        Trainer(Config.from_dict(cfg)).train()
    assert err.value.one_line() == (f"output_dir {tmp_path / 'run'} is in use by another run (pid {proc.pid}) "
                                    "(hint: wait for it to finish, stop it, or choose another output_dir)")
    _wait_for(tmp_path / "run" / "checkpoints" / "step-000003", proc)
    proc.kill()
    proc.wait()
    assert not (tmp_path / "run" / "adapter").exists()
    Trainer(Config.from_dict(cfg)).train()
    _assert_same(_adapter(tmp_path / "run"), reference)
    steps = [json.loads(l)["step"] for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))


def test_dropout_changes_the_adapter(tiny_llama, uninterrupted, tmp_path):
    """So bitwise equality above says the dropout masks were replayed, not that there were none."""
    data, reference = uninterrupted
    cfg = _cfg(tiny_llama, data, tmp_path / "run")
    cfg["lora"]["dropout"] = 0.0
    Trainer(Config.from_dict(cfg)).train()
    assert any(not torch.equal(a, reference[k]) for k, a in _adapter(tmp_path / "run").items())


def test_stop_signals_checkpoint_exit_75_and_resume(tiny_llama, uninterrupted, tmp_path):
    """SIGTERM, SIGINT and SIGUSR1, each sent to its own run after its second checkpoint. The three
    runs train at the same time (most of a run's time is its process importing torch)."""
    data, reference = uninterrupted
    names = ["SIGTERM", "SIGINT", "SIGUSR1"]
    cfgs = {name: _cfg(tiny_llama, data, tmp_path / name / "run") for name in names}
    procs = {}
    try:
        for name in names:
            (tmp_path / name).mkdir()
            procs[name] = _start(cfgs[name], tmp_path / name)
        waiting, t0 = set(names), time.time()
        while waiting:  # each run gets its signal as soon as its step-2 checkpoint is there
            for name in sorted(waiting):
                if (tmp_path / name / "run" / "checkpoints" / "step-000002").exists():
                    procs[name].send_signal(getattr(signal, name))
                    waiting.remove(name)
                else:
                    assert procs[name].poll() is None, (name, procs[name].communicate())
            assert time.time() - t0 < 240
            time.sleep(0.05)
        for name in names:
            run = tmp_path / name / "run"
            proc = procs[name]
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 75, (name, err)
            last = err.strip().splitlines()[-1]
            assert last.startswith(f"error: stopped by {name} after step ")
            assert last.endswith(f"/{STEPS}; checkpoint saved in {run / 'checkpoints'} "
                                 "(hint: re-run the same command to resume)")
            stopped_at = int(last.split("after step ")[1].split("/")[0])
            assert (run / "checkpoints" / f"step-{stopped_at:06d}").is_dir()
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for name in names:
        Trainer(Config.from_dict(cfgs[name])).train()
        _assert_same(_adapter(tmp_path / name / "run"), reference)


def test_truncated_newest_checkpoint_falls_back_and_finishes(tiny_llama, uninterrupted, tmp_path, capsys):
    data, reference = uninterrupted
    cfg = _cfg(tiny_llama, data, tmp_path / "run")
    Trainer(Config.from_dict(cfg)).train()  # checkpoints at 7 and 8 remain
    newest = tmp_path / "run" / "checkpoints" / f"step-{STEPS:06d}" / "trainable.safetensors"
    newest.write_bytes(newest.read_bytes()[:100])
    cfg["logging"] = {"progress": "plain"}
    Trainer(Config.from_dict(cfg)).train()
    err = capsys.readouterr().err
    assert f"warning: skipping corrupt checkpoint step-{STEPS:06d}" in err
    assert f"resuming from {tmp_path / 'run' / 'checkpoints' / f'step-{STEPS - 1:06d}'}" in err
    _assert_same(_adapter(tmp_path / "run"), reference)


def test_non_finite_step_is_skipped(tiny_llama, pc_data, tmp_path):
    def poison(trainer, step):
        if step == 2:
            p = next(p for p in trainer.model.parameters() if p.requires_grad)
            p.grad[0, 0] = float("nan")

    cfg = Config.from_dict(tiny_config(tiny_llama, pc_data, tmp_path / "run", eval={"enabled": False}))
    trainer = Trainer(cfg, hooks={"after_backward": poison})
    summary = trainer.train()
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[1]["skipped"] is True and rows[1]["loss"] is None
    assert all(r.get("skipped") is None for i, r in enumerate(rows) if i != 1)
    assert summary["skipped_steps"] == 1
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_too_many_bad_steps_stop_with_message(tiny_llama, pc_data, tmp_path):
    def poison(trainer, step):
        for p in trainer.model.parameters():
            if p.grad is not None:
                p.grad.fill_(math.inf)

    cfg = Config.from_dict(tiny_config(tiny_llama, pc_data, tmp_path / "run", eval={"enabled": False},
                                       training={"max_bad_steps": 2}))
    with pytest.raises(TrainingError) as err:
        Trainer(cfg, hooks={"after_backward": poison}).train()
    assert err.value.one_line() == ("2 consecutive steps had a non-finite loss or gradient (last: step 2) "
                                    "(hint: lower training.learning_rate or check the data; the last good checkpoint is kept)")
