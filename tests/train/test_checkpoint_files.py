"""Checkpoints are atomic, verified, pruned, and a failed save never hurts the previous one."""
import errno
import json

import pytest
import torch

from maximus.errors import CheckpointError
from maximus.train import checkpoint as ck
from maximus.train.lock import RunLock


def _model_and_opt(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    model[0].weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def test_roundtrip_restores_params_optimizer_and_rng(tmp_path):
    model, opt = _model_and_opt()
    torch.manual_seed(123)
    ck.save_checkpoint(tmp_path, 5, model, opt, {"position": 40}, keep=2)
    expected_next = torch.rand(3)
    other, other_opt = _model_and_opt(seed=1)
    state = ck.latest_good_checkpoint(tmp_path).restore(other, other_opt)
    assert state["step"] == 5 and state["position"] == 40
    for (n, a), b in zip(model.named_parameters(), other.parameters()):
        if a.requires_grad:
            assert torch.equal(a, b), n
    sa, sb = opt.state_dict(), other_opt.state_dict()
    for k in sa["state"]:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(sa["state"][k][key]), torch.as_tensor(sb["state"][k][key]))
    assert torch.equal(torch.rand(3), expected_next)  # RNG restored


def test_keeps_newest_k_and_leaves_no_temporaries(tmp_path):
    model, opt = _model_and_opt()
    for step in (1, 2, 3, 4):
        ck.save_checkpoint(tmp_path, step, model, opt, {}, keep=2)
    assert [c.step for c in ck.list_checkpoints(tmp_path)] == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000003", "step-000004"]


def test_truncated_newest_falls_back_with_warning(tmp_path):
    model, opt = _model_and_opt()
    ck.save_checkpoint(tmp_path, 1, model, opt, {}, keep=3)
    ck.save_checkpoint(tmp_path, 2, model, opt, {}, keep=3)
    f = tmp_path / "step-000002" / "trainable.safetensors"
    f.write_bytes(f.read_bytes()[:-7])
    warnings = []
    good = ck.latest_good_checkpoint(tmp_path, warn=warnings.append)
    assert good.step == 1
    size = json.loads((tmp_path / "step-000002" / "manifest.json").read_text())["files"]["trainable.safetensors"]["bytes"]
    assert warnings == [f"warning: skipping corrupt checkpoint step-000002: trainable.safetensors has {size - 7} bytes, "
                        f"expected {size}; falling back to the previous one"]


def test_disk_full_keeps_previous_checkpoint(tmp_path, monkeypatch):
    model, opt = _model_and_opt()
    ck.save_checkpoint(tmp_path, 1, model, opt, {}, keep=2)
    before = {p.name: p.read_bytes() for p in (tmp_path / "step-000001").iterdir()}
    real = ck._save_tensors
    calls = {"n": 0}

    def failing(tensors, path):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(tensors, path)

    monkeypatch.setattr(ck, "_save_tensors", failing)
    with pytest.raises(CheckpointError) as err:
        ck.save_checkpoint(tmp_path, 2, model, opt, {}, keep=2)
    assert err.value.one_line() == (f"could not write checkpoint {tmp_path / 'step-000002'}: No space left on device "
                                    "(hint: free disk space; the previous checkpoint is intact and the run can resume from it)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001"]
    assert {p.name: p.read_bytes() for p in (tmp_path / "step-000001").iterdir()} == before
    assert ck.latest_good_checkpoint(tmp_path).step == 1


def test_second_lock_on_same_dir_refuses(tmp_path):
    import os

    with RunLock(tmp_path / "run"):
        with pytest.raises(CheckpointError) as err:
            RunLock(tmp_path / "run").acquire()
        assert err.value.one_line() == (f"output_dir {tmp_path / 'run'} is in use by another run (pid {os.getpid()}) "
                                        "(hint: wait for it to finish, stop it, or choose another output_dir)")
    RunLock(tmp_path / "run").acquire()  # released: free again
