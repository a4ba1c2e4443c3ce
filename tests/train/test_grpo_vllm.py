"""`grpo.generation: vllm` on a GPU: two steps of a tiny LoRA run sampled by the colocated
engine with the adapter synced before each generation. Skipped without CUDA or vllm (the
prepared GPU check, docs/benchmarks/gpu.md, cannot carry vllm, so it does not run it yet)."""
import importlib.util
import json

import pytest
import torch

import maximus
from test_grpo_objective import G, MAX_TOKENS, config, tiny  # noqa: F401  (tiny: a fixture)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
                                reason="grpo.generation: vllm needs CUDA and the vllm package")


def test_vllm_generation_trains_on_completions_sampled_with_the_synced_adapter(tiny, tmp_path):
    out = tmp_path / "run"
    cfg = config(tiny, out, grpo={"generation": "vllm"}, training={"max_steps": 2, "dtype": "bf16"},
                 eval={"enabled": False}, device="cuda")
    trainer = maximus.Trainer(maximus.Config.from_dict(cfg))
    trainer.train()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(1 <= r["completion_length"] <= MAX_TOKENS for r in rows)
    assert trainer.objective._vllm.version == 2  # the adapter reached the engine before each generation
    assert len(trainer.objective.generation.rows) == 2 * G


def test_a_resumed_run_samples_with_a_new_adapter_version(tiny, tmp_path):
    """Run again after its last checkpoint (one engine per process, as a user resumes): the
    resumed run's first sync writes version 3 beside the surviving copies, where it used to start
    again at 1 and fail on the surviving vllm_adapter/1."""
    import subprocess
    import sys

    import yaml

    out = tmp_path / "run"
    cfg = config(tiny, out, grpo={"generation": "vllm"}, training={"max_steps": 2, "dtype": "bf16", "save_every": 1},
                 eval={"enabled": False}, device="cuda")
    path = tmp_path / "run.yaml"
    for steps in (2, 3):
        cfg["training"]["max_steps"] = steps
        path.write_text(yaml.safe_dump(cfg))
        subprocess.run([sys.executable, "-m", "maximus.cli", "train", "--config", str(path)], check=True, timeout=900)
    assert sorted(p.name for p in (out / "vllm_adapter").iterdir()) == ["2", "3"]
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
