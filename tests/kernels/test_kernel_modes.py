"""`optimization.kernels`: what each mode does on this CPU, and that the compiled step computes
what the eager one does."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from maximus import Config, Trainer
from maximus.kernels import apply_kernels
from tiny import build_tiny_model_dir, tiny_config, write_prompt_completion


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("kern") / "m", layers=1)


def _load(path):
    return AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="sdpa", dtype=torch.float32)


def test_auto_and_eager_on_cpu_are_eager_with_padding_free_attention(model_dir):
    for mode in ("auto", "eager"):
        model = _load(model_dir)
        report = apply_kernels(model, mode, torch.device("cpu"))
        assert (report.used, report.notices, report.patched) == ("eager", [], [])
        assert report.attention == "padding-free (per-document SDPA)"
        assert model.config._attn_implementation == "maximus_varlen"


def test_triton_on_cpu_falls_back_with_one_notice(model_dir):
    report = apply_kernels(_load(model_dir), "triton", torch.device("cpu"))
    assert report.used == "eager"
    assert report.notices == ["notice: optimization.kernels=triton is not available here "
                              "(Triton kernels need a CUDA GPU, training runs on cpu); running eager PyTorch"]


def test_compiled_layers_match_eager_forward_and_backward(model_dir):
    eager = _load(model_dir).train()
    compiled = copy.deepcopy(eager)
    report = apply_kernels(compiled, "compile", torch.device("cpu"))
    assert (report.used, report.patched) == ("compile", ["layers.0"])
    ids = torch.randint(0, eager.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(10), torch.arange(14)]).expand(2, -1)  # two packed documents per row
    grads = []
    for model in (eager, compiled):
        out = model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False)
        out.loss.backward()
        grads.append((out.loss.detach(), model.model.layers[0].mlp.up_proj.weight.grad))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[1][1], grads[0][1], rtol=1e-4, atol=1e-5)


def test_run_json_records_the_kernels(model_dir, tmp_path):
    data = write_prompt_completion(tmp_path / "d.jsonl", n=16)
    cfg = Config.from_dict(tiny_config(model_dir, data, tmp_path / "run", eval={"enabled": False},
                                       training={"batch_size": 2, "micro_batch_size": 2, "max_steps": 1, "seq_len": 64,
                                                 "dtype": "fp32", "warmup_steps": 0},
                                       optimization={"kernels": "triton", "gradient_checkpointing": "off"}))
    Trainer(cfg).train()
    kernels = json.loads((tmp_path / "run" / "run.json").read_text())["kernels"]
    assert kernels["requested"] == "triton" and kernels["used"] == "eager"
    assert kernels["attention"] == "padding-free (per-document SDPA)"


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_cpu_threads_leave_busy_cores_alone(monkeypatch, restore_threads):
    from maximus.kernels import busy_cores, cpu_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    cpu = torch.device("cpu")
    assert cpu_threads(cpu, busy=0, cores=8) == 8 and torch.get_num_threads() == 8
    assert cpu_threads(cpu, busy=3, cores=8) == 5
    assert cpu_threads(cpu, 4, busy=0, cores=8) == 2  # four processes on this node share the cores
    assert cpu_threads(cpu, busy=7, cores=2) == 1  # never fewer than one
    assert cpu_threads(torch.device("meta"), busy=0, cores=8) is None
    assert busy_cores() >= 0
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    torch.set_num_threads(3)
    assert cpu_threads(cpu, busy=0, cores=8) == 3  # an explicit setting wins
