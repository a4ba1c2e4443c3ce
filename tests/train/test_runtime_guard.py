"""The runtime guard, on a real over-budget run: a custom architecture the estimator does not
know (its MLP is 8x wider than config.json's intermediate_size says), so the plan's prediction
is wrong by construction. The first step's measured peak (the CPU meter) passes the budget; the
trainer re-plans downward, records it in run.json `replans`, keeps the effective batch, and the
following steps stay under the budget."""
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from maximus import Config, Trainer
from maximus.memory import plan_run

from tiny import build_tiny_model_dir, one_thread, tiny_config, write_prompt_completion  # noqa: F401 - fixture

pytestmark = pytest.mark.usefixtures("one_thread")

HERE = Path(__file__).parent
MODELING = HERE / "wide_llama" / "modeling_wide_llama.py"


def build_wide_llama(path: Path, expansion: int = 8) -> Path:
    """A tiny `WideLlamaForCausalLM` saved with its code (auto_map), loadable with trust_remote_code."""
    import torch

    build_tiny_model_dir(path, "llama")  # tokenizer and a Llama config to widen
    spec = importlib.util.spec_from_file_location("modeling_wide_llama", MODELING)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    base = json.loads((path / "config.json").read_text())
    for key in ("architectures", "model_type", "transformers_version", "dtype", "torch_dtype"):
        base.pop(key, None)
    torch.manual_seed(0)
    model = module.WideLlamaForCausalLM(module.WideLlamaConfig(mlp_expansion=expansion, **base))
    for f in path.glob("*.safetensors"):
        f.unlink()
    model.save_pretrained(str(path), safe_serialization=True)
    shutil.copy(MODELING, path / MODELING.name)
    config = json.loads((path / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "modeling_wide_llama.WideLlamaConfig",
                          "AutoModelForCausalLM": "modeling_wide_llama.WideLlamaForCausalLM"}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def test_measured_peak_over_budget_replans_downward_and_is_recorded(tmp_path):
    model = build_wide_llama(tmp_path / "wide")
    data = write_prompt_completion(tmp_path / "data.jsonl", n=32)
    run = tiny_config(model, data, tmp_path / "out", trust_remote_code=True,
                      training={"batch_size": 4, "micro_batch_size": "auto", "max_steps": 4},
                      optimization={"gradient_checkpointing": "auto"}, eval={"enabled": False})
    # The budget the estimator thinks the fastest plan (micro-batch 4, no recompute) just fits.
    fastest = dict(run, training={**run["training"], "micro_batch_size": 4},
                   optimization={"gradient_checkpointing": "off"})
    predicted = plan_run(Config.from_dict(fastest), device="cpu", budget_bytes=None).peak_bytes
    budget = int(predicted / 0.9) + 1
    cfg = Config.from_dict(dict(run, optimization={**run["optimization"], "target_vram": budget}))
    first = plan_run(cfg, device="cpu")
    assert (first.micro_batch_size, set(first.recompute)) == (4, {"none"}) and first.peak_bytes == predicted

    summary = Trainer(cfg).train()

    run_json = json.loads((tmp_path / "out" / "run.json").read_text())
    assert run_json["replans"] == summary["replans"]
    first_replan = run_json["replans"][0]
    assert first_replan["step"] == 1 and first_replan["reason"] == (
        f"measured peak {first_replan['measured_peak_bytes']:,} bytes over the budget of {budget:,}")
    assert first_replan["measured_peak_bytes"] > budget
    final = run_json["plan"]
    assert final["peak_bytes"] < predicted  # re-planned downward
    assert final["effective_batch"] == 4 and final["budget_bytes"] == budget
    assert (final["micro_batch_size"], final["recompute"]) != (4, ["none", "none"])
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "peak_memory_bytes" in r]
    assert steps[0]["peak_memory_bytes"] == first_replan["measured_peak_bytes"]
    last = run_json["replans"][-1]["step"]
    assert last < 4 and all(r["peak_memory_bytes"] <= budget for r in steps if r["step"] > last)
