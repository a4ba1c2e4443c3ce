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
