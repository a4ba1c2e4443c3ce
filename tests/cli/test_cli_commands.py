"""export / eval / generate on a finished run."""
import json

import torch
import yaml

from maximus.cli import main, train_main
from maximus.config import format_bytes

from tiny import tiny_config


def test_train_then_export_eval_generate(tiny_llama, pc_data, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from maximus.export import load_tuned

    cfg = tiny_config(tiny_llama, pc_data, tmp_path / "run", training={"max_steps": 3})
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(cfg))
    assert train_main(["--config", str(p)]) == 0
    out = capsys.readouterr().out
    assert "held-out loss" in out and "base (before)" in out

    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    tuned, _ = load_tuned(tmp_path / "run")
    ids = torch.randint(2, 200, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, tuned(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
    assert (tmp_path / "merged" / "model.safetensors").is_file()
    assert not list((tmp_path / "merged").glob("*.bin"))

    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    recorded = json.loads((tmp_path / "run" / "run.json").read_text())["eval"]
    assert abs(result["after"]["loss"] - recorded["after"]["loss"]) < 1e-4
    assert abs(result["before"]["loss"] - recorded["before"]["loss"]) < 1e-4
    summary = json.loads((tmp_path / "run" / "run.json").read_text())
    predicted = summary["plan"]["peak_bytes"]
    assert predicted > 0
    assert result["memory"] == {"peak_bytes": summary["memory"]["peak_bytes"], "budget_bytes": None,
                                "predicted_peak_bytes": predicted}
    # The table and the plot: this evaluation's held-out points on the run's loss, and the memory panel.
    from maximus.train.progress import read_metrics, run_figure

    assert main(["eval", str(tmp_path / "run"), "--plot", str(tmp_path / "eval.png")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2] == (f"training memory: peak {format_bytes(summary['memory']['peak_bytes'])} measured, budget -, "
                         f"planner prediction {format_bytes(predicted)}")
    assert lines[-1] == f"wrote {tmp_path / 'eval.png'}" and (tmp_path / "eval.png").stat().st_size > 1000
    fig = run_figure(read_metrics(tmp_path / "run" / "metrics.jsonl"),
                     {**summary, "eval": {"before": result["before"], "after": result["after"]}})
    held_out = next(l for l in fig.axes[0].get_lines() if l.get_label() == "held-out loss (exact)")
    assert list(held_out.get_xdata()) == [0, 3]

    assert main(["generate", str(tmp_path / "run"), "-p", "Reverse: red gold stone\nAnswer:", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("Reverse: red gold stone\nAnswer:")
