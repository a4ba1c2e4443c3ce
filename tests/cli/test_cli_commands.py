"""export / eval / generate on a finished run."""
import json

import torch
import yaml

from maximus.cli import main, train_main

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

    assert main(["generate", str(tmp_path / "run"), "-p", "Reverse: red gold stone\nAnswer:", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("Reverse: red gold stone\nAnswer:")
