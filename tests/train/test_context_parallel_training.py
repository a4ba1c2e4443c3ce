"""Context parallelism over torchrun, gloo on CPU, one launch per world size (the ranks run
`context_parallel_worker.py`):

- attention: ring and Ulysses over 2 and 4 processes equal one process's SDPA on the whole row,
  outputs and the gradients of queries, keys and values (MHA and GQA, plain causal rows and
  packed documents whose boundaries fall inside chunks and across ranks) to 1e-5 in fp32; and
  causality by perturbation: changing every input after position t changes no output at or
  before t on any rank (and does change later ones);
- training (`training.context_parallel` = the world size): the loss and every LoRA gradient of
  two optimizer steps equal one process's on the same packed rows to 1e-5 in fp32, for GQA
  models of two families. Two processes run Ulysses on Llama and Qwen2 (4 query / 2 key-value
  heads); four run Ulysses with the key-value heads repeated (Llama) and ring attention on a
  Qwen2 whose 2 heads do not divide by 4 (with its notice), both Qwen2 runs with full gradient
  checkpointing (the recomputed layers exchange again inside the backward); DPO over 2 processes (chosen and
  rejected rows split alike, reference log-probs with the adapter off). Two torchrun nodes on this machine
  (`--nnodes 2`) train Llama as one process does;
- the refusals, each one line.
"""
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from context_parallel_worker import two_steps
from maximus import Config
from maximus.errors import ConfigError
from maximus.train.context_parallel import ContextParallel
from maximus.train.distributed import DistEnv
from test_distributed_dpo import _pairs
from tiny import build_tiny_model_dir, tiny_config, write_prompt_completion
from two_ranks import rank_report, run_two_nodes, run_two_ranks

WORKER = Path(__file__).with_name("context_parallel_worker.py")
MODELS = {2: {"llama": ("llama", 4, 2), "qwen2": ("qwen2", 4, 2), "llama_dpo": ("llama", 4, 2)},
          4: {"llama": ("llama", 4, 2), "qwen2_ring": ("qwen2", 2, 1)}}
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _cfg(model: Path, data: Path, out: Path, ranks: int, *, dpo: bool = False, checkpointing: bool = False) -> dict:
    cfg = tiny_config(model, data, out, eval={"enabled": False},
                      training={"batch_size": 2, "micro_batch_size": 1, "max_steps": 2, "seq_len": 96,
                                "context_parallel": ranks, "max_grad_norm": None})
    if dpo:  # pairs of unequal lengths: the shorter side is padded, and both are split alike
        cfg.update(objective="dpo", dataset={"path": str(data.with_name("pairs.jsonl")), "format": "preference"})
    if checkpointing:  # recomputed layers attend again, inside the backward
        cfg["optimization"]["gradient_checkpointing"] = "full"
    return cfg


def _launch_spec(tmp: Path, ranks: int, names: dict, *, attention: bool) -> Path:
    data = tmp / "data.jsonl"
    if not data.exists():
        write_prompt_completion(data, n=16)
        _pairs(tmp / "pairs.jsonl", n=8)
    configs = {}
    for name, (arch, heads, kv_heads) in names.items():
        model = tmp / name
        if not model.exists():
            build_tiny_model_dir(model, arch, heads=heads, kv_heads=kv_heads)
        configs[name] = _cfg(model, data, tmp / f"{name}-split", ranks, dpo=name.endswith("dpo"),
                             checkpointing=name.startswith("qwen2"))
    spec = tmp / "launch.json"
    spec.write_text(json.dumps({"attention": attention, "configs": configs}))
    return spec


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def launched(request, tmp_path_factory):
    ranks = request.param
    tmp = tmp_path_factory.mktemp(f"cp{ranks}")
    spec = _launch_spec(tmp, ranks, MODELS[ranks], attention=True)
    proc = run_two_ranks([str(WORKER), str(spec), str(tmp)], tmp / "logs", env=ENV, nproc=ranks, timeout_s=400)
    assert proc.returncode == 0, rank_report(proc, tmp / "logs")
    return ranks, tmp, proc


def test_split_attention_equals_one_process(launched):
    ranks, tmp, _ = launched
    for rank in range(ranks):
        results = json.loads((tmp / f"attention-rank{rank}.json").read_text())
        assert len(results) == 12
        for case, errors in results.items():
            if case.endswith("perturbation"):
                assert errors["early"] == 0.0, (rank, case)
                assert errors["late"] > 0.1, (rank, case)
            else:
                assert set(errors) == {"out", "grad_q", "grad_k", "grad_v"}
                assert max(errors.values()) < 1e-5, (rank, case, errors)


#: One-process results by config name: a name is the same model (same seed and heads), data and
#: settings in every launch, so its oracle runs once per session.
_ONE_PROCESS: dict[str, dict] = {}


def _assert_equals_one_process(tmp: Path, name: str, cfg: dict) -> None:
    split = load_file(str(tmp / f"{name}.safetensors"))
    if name not in _ONE_PROCESS:
        one_cfg = {**cfg, "output_dir": str(tmp / f"{name}-one"), "training": {**cfg["training"], "context_parallel": 1}}
        _ONE_PROCESS[name] = two_steps(one_cfg)[0]
    one = _ONE_PROCESS[name]
    assert split.keys() == one.keys() and len(one) > 2
    torch.testing.assert_close(split["loss"], one["loss"], rtol=0, atol=1e-5)
    for key in one:
        torch.testing.assert_close(split[key], one[key], rtol=0, atol=1e-5, msg=key)
    assert any(one[k].abs().max() > 1e-3 for k in one if k.startswith("2/") and "lora_A" in k)


def test_split_rows_train_as_one_process(launched):
    ranks, tmp, proc = launched
    configs = json.loads((tmp / "launch.json").read_text())["configs"]
    ring = "qwen2_ring" in configs
    assert ("the model's 2 attention heads do not divide by 4; attention runs as ring attention" in proc.stderr) == ring
    for name, cfg in configs.items():
        assert f"{name}: exchange {'ring' if name.endswith('ring') else 'ulysses'}" in proc.stdout
        _assert_equals_one_process(tmp, name, cfg)


def test_two_torchrun_nodes_train_as_one_process(tmp_path):
    spec = _launch_spec(tmp_path, 2, {"llama": MODELS[2]["llama"]}, attention=False)
    out = run_two_nodes([str(WORKER), str(spec), str(tmp_path)], tmp_path / "logs", env=ENV, timeout_s=400)
    assert "llama: exchange ulysses" in out
    _assert_equals_one_process(tmp_path, "llama", json.loads(spec.read_text())["configs"]["llama"])


def test_context_parallel_must_divide_the_world():
    with pytest.raises(ConfigError) as err:
        ContextParallel.join(DistEnv(True, world_size=6, rank=0), 4)
    assert str(err.value) == ("training.context_parallel (4) does not divide the number of processes (6) "
                              "(hint: launch with torchrun --nproc_per_node a multiple of 4, or change context_parallel)")


@pytest.mark.parametrize("section, value, message", [
    ("optimization", {"kronecker_sketching": True},
     "training.context_parallel 2 cannot split Kronecker Sketching attention (optimization.kronecker_sketching): "
     "its sketch summarises the whole row on one process (hint: turn off optimization.kronecker_sketching or "
     "set training.context_parallel: 1)"),
    ("objective", "contrastive", "training.context_parallel 2 supports objectives sft, dpo and grpo, not contrastive "
                                 "(hint: set training.context_parallel: 1)"),
])
def test_what_cannot_be_split_is_refused_before_loading(section, value, message):
    raw = {"model": "m", "dataset": "d.jsonl", "training": {"context_parallel": 2}}
    if isinstance(value, dict):
        raw.setdefault(section, {}).update(value)
    else:
        raw[section] = value
    with pytest.raises(ConfigError) as err:
        Config.from_dict(raw)
    assert str(err.value) == f"config: {message}"
