"""Context parallelism composed with the rest of a run, over four torchrun processes (gloo on
CPU) in one launch (the ranks run `context_parallel_worker.py`), each config against one process
on the same rows (loss and every LoRA gradient of two optimizer steps):

- FSDP2 on a 2-D device mesh, shard x context: 2 x 2 ranks, each pair splits its rows and the
  two pairs take different rows, parameters sharded over all 4 (LoRA, fp32): to 1e-5;
- QLoRA (bitsandbytes 4-bit base) with full gradient checkpointing and sequence-tiled MLP
  recompute (tiles of 16 tokens), lean LoRA and lean norms, over 4 ranks: to 1e-5 in fp32;
- the same QLoRA in bf16 (the only difference from the fp32 config) against one bf16 process. bf16's own rounding is measured in the same
  test (one process in bf16 against one in fp32, the same rows) and each tensor of the split may
  differ from the bf16 process by at most twice that tensor's bf16 rounding: the split reorders
  bf16 sums (whole-row matmuls become share-sized ones), so it moves a result by about as much as
  bf16 itself does (measured on a 2-core AMD EPYC with AVX512-BF16: at most 0.86x, median 0.15x),
  while a wrong split (a missed row part, a wrong normalisation) moves it by the gradient itself;
- DPO over 4 ranks: chosen and rejected rows split alike, to 1e-5;
- GRPO's training pass over 4 ranks (generation is not split: every rank samples the whole
  completions and keeps the first rank's), loss type ``grpo`` (each token divided by its whole
  completion's length), a KL term to the reference and a second update on the same completions
  (the kept sampling log-probs split alike), to 1e-5.
"""
import copy
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from context_parallel_worker import two_steps
from test_distributed_dpo import _pairs
from test_grpo_objective import REWARDS, write_prompts
from tiny import build_tiny_model_dir, tiny_config, write_prompt_completion
from two_ranks import rank_report, run_two_ranks

WORKER = Path(__file__).with_name("context_parallel_worker.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
RANKS = 4


def _configs(tmp: Path) -> dict[str, dict]:
    data, pairs, model = tmp / "data.jsonl", tmp / "pairs.jsonl", tmp / "llama"
    write_prompt_completion(data, n=16)
    _pairs(pairs, n=8)
    build_tiny_model_dir(model, "llama", heads=4, kv_heads=2)

    def cfg(name: str, degree: int, **sections) -> dict:
        return tiny_config(model, data, tmp / f"{name}-split", eval={"enabled": False},
                           training={"batch_size": 2, "micro_batch_size": 1, "max_steps": 2, "seq_len": 96,
                                     "context_parallel": degree, "max_grad_norm": None}, **sections)

    fsdp = cfg("fsdp", 2)
    fsdp["training"]["distributed"] = "fsdp"
    qlora = cfg("qlora", RANKS, method="qlora", optimization={"gradient_checkpointing": "full", "tile_tokens": 16})
    qlora_bf16 = copy.deepcopy(qlora)
    qlora_bf16.update(output_dir=str(tmp / "qlora_bf16-split"))
    qlora_bf16["training"]["dtype"] = "bf16"
    dpo = cfg("dpo", RANKS, objective="dpo")
    dpo["dataset"] = {"path": str(pairs), "format": "preference"}
    grpo = cfg("grpo", RANKS, objective="grpo",
               grpo={"group_size": 4, "max_completion_tokens": 6, "rewards": [f"{REWARDS}:word_count"], "beta": 0.1,
                     "loss_type": "grpo", "updates_per_generation": 2})
    grpo["training"]["micro_batch_size"] = 4
    grpo["dataset"] = {"path": str(write_prompts(tmp / "prompts.jsonl")), "format": "prompt"}
    return {"fsdp": fsdp, "qlora": qlora, "qlora_bf16": qlora_bf16, "dpo": dpo, "grpo": grpo}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cp-compose")
    configs = _configs(tmp)
    spec = tmp / "launch.json"
    spec.write_text(json.dumps({"attention": False, "configs": configs}))
    proc = run_two_ranks([str(WORKER), str(spec), str(tmp)], tmp / "logs", env=ENV, nproc=RANKS, timeout_s=400)
    assert proc.returncode == 0, rank_report(proc, tmp / "logs")
    return tmp, configs, proc


#: One-process results by config name, run once per session (the fp32 QLoRA one serves twice).
_ONE_PROCESS: dict[str, dict[str, torch.Tensor]] = {}


def _one_process(tmp: Path, configs: dict, name: str) -> dict[str, torch.Tensor]:
    if name not in _ONE_PROCESS:
        cfg = configs[name]
        one = {**cfg, "output_dir": str(tmp / f"{name}-one"), "training": {**cfg["training"], "context_parallel": 1}}
        _ONE_PROCESS[name] = two_steps(one)[0]
    return _ONE_PROCESS[name]


def _split(tmp: Path, name: str) -> dict[str, torch.Tensor]:
    return load_file(str(tmp / f"{name}.safetensors"))


def _assert_trained(result: dict[str, torch.Tensor]) -> None:
    """The second step's adapter gradients are not all zero (the first step's lora_A ones are:
    lora_B starts at zero), so the comparisons below compare something."""
    assert any(result[k].abs().max() > 1e-3 for k in result if k.startswith("2/") and "lora_A" in k)


@pytest.mark.parametrize("name", ["fsdp", "qlora", "dpo", "grpo"])
def test_split_equals_one_process_in_fp32(launched, name):
    tmp, configs, proc = launched
    assert f"{name}: exchange ulysses, strategy {'fsdp' if name == 'fsdp' else 'ddp'}" in proc.stdout
    split, one = _split(tmp, name), _one_process(tmp, configs, name)
    assert split.keys() == one.keys() and len(one) > 2
    _assert_trained(one)
    for key in one:
        torch.testing.assert_close(split[key], one[key], rtol=0, atol=1e-5, msg=key)


def test_split_in_bf16_is_within_bf16_rounding_of_one_bf16_process(launched):
    tmp, configs, _ = launched
    split = _split(tmp, "qlora_bf16")
    one_bf16, one_fp32 = _one_process(tmp, configs, "qlora_bf16"), _one_process(tmp, configs, "qlora")
    _assert_trained(one_bf16)
    assert split.keys() == one_bf16.keys()
    for key in one_bf16:
        rounding = (one_bf16[key].double() - one_fp32[key].double()).abs().max().item()
        error = (split[key].double() - one_bf16[key].double()).abs().max().item()
        assert error <= 2 * rounding, (key, error, rounding)
    assert (one_bf16["loss"] - one_fp32["loss"]).abs().max() > 1e-5  # bf16 really ran

