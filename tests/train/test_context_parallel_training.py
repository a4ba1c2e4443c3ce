"""`training.context_parallel` = the world size (2 and 4 gloo processes): each row's tokens are
split over the ranks, and the loss and every LoRA gradient of two optimizer steps equal one
process's on the same rows to 1e-5 in fp32, with packed rows (documents crossing the ranks'
shares) and GQA models of two families. Two processes run Ulysses on Llama and Qwen2 (4 query /
2 key-value heads); four run Ulysses with the key-value heads repeated (Llama) and ring attention
on a Qwen2 whose 2 heads do not divide by 4 (with its notice). The ranks run
`context_parallel_training_worker.py`. Then the config's refusals, each one line."""
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from context_parallel_training_worker import two_steps
from maximus import Config
from maximus.errors import ConfigError
from maximus.train.context_parallel import ContextParallel
from maximus.train.distributed import DistEnv
from tiny import build_tiny_model_dir, tiny_config, write_prompt_completion
from two_ranks import rank_report, run_two_ranks

WORKER = Path(__file__).with_name("context_parallel_training_worker.py")
MODELS = {2: {"llama": ("llama", 4, 2), "qwen2": ("qwen2", 4, 2)},
          4: {"llama": ("llama", 4, 2), "qwen2_ring": ("qwen2", 2, 1)}}


def _cfg(model: Path, data: Path, out: Path, ranks: int) -> dict:
    return tiny_config(model, data, out, eval={"enabled": False},
                       training={"batch_size": 2, "micro_batch_size": 1, "max_steps": 2, "seq_len": 96,
                                 "context_parallel": ranks, "max_grad_norm": None})


@pytest.mark.parametrize("ranks", [2, 4])
def test_split_rows_train_as_one_process(tmp_path, ranks):
    data = write_prompt_completion(tmp_path / "data.jsonl", n=16)
    configs = {}
    for name, (arch, heads, kv_heads) in MODELS[ranks].items():
        model = build_tiny_model_dir(tmp_path / name, arch, heads=heads, kv_heads=kv_heads)
        configs[name] = _cfg(model, data, tmp_path / f"{name}-split", ranks)
    (tmp_path / "configs.json").write_text(json.dumps(configs))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    logs = tmp_path / "logs"
    proc = run_two_ranks([str(WORKER), str(tmp_path / "configs.json"), str(tmp_path)], logs, env=env,
                         nproc=ranks, timeout_s=400)
    assert proc.returncode == 0, rank_report(proc, logs)
    ring = "qwen2_ring" in configs
    assert ("the model's 2 attention heads do not divide by 4; attention runs as ring attention" in proc.stderr) == ring
    for name, cfg in configs.items():
        assert f"{name}: exchange {'ring' if name.endswith('ring') else 'ulysses'}" in proc.stdout
        split = load_file(str(tmp_path / f"{name}.safetensors"))
        one_cfg = {**cfg, "output_dir": str(tmp_path / f"{name}-one"),
                   "training": {**cfg["training"], "context_parallel": 1}}
        one, _ = two_steps(one_cfg)
        assert split.keys() == one.keys() and len(one) > 2
        torch.testing.assert_close(split["loss"], one["loss"], rtol=0, atol=1e-5)
        for key in one:
            torch.testing.assert_close(split[key], one[key], rtol=0, atol=1e-5, msg=key)
        assert any(one[k].abs().max() > 1e-3 for k in one if k.startswith("2/") and "lora_A" in k)


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
    ("training", {"distributed": "fsdp"},
     "training.context_parallel 2 runs under DDP, not training.distributed: fsdp "
     "(hint: set training.distributed: ddp or auto)"),
    ("objective", "dpo", "training.context_parallel 2 supports objective sft only, not dpo "
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
