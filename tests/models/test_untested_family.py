"""A causal LM outside the tested family matrix trains, with one notice naming its family and
saying the planner's figures for it are not verified; a tested family trains without it."""
from __future__ import annotations

import yaml

from maximus.cli import main
from tiny import save_random_model, tiny_config

NOTICE = ("notice: OlmoForCausalLM (model type 'olmo') is outside the tested model families (docs/models.md): it "
          "trains through Transformers' own layers, and the planner's memory figures for it are not verified")


def test_an_untested_family_is_named_once(tmp_path, tiny_llama, pc_data, capsys):
    from transformers import AutoTokenizer, OlmoConfig, OlmoForCausalLM

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    olmo = save_random_model(tmp_path / "olmo", OlmoForCausalLM,
                             OlmoConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, pad_token_id=tok.pad_token_id,
                                        eos_token_id=tok.eos_token_id, bos_token_id=None), tok)
    for model, notices in ((olmo, [NOTICE]), (tiny_llama, [])):
        config = tmp_path / "run.yaml"
        config.write_text(yaml.safe_dump(tiny_config(model, pc_data, tmp_path / f"run-{model.name}",
                                                     training={"max_steps": 1}, eval={"enabled": False})))
        capsys.readouterr()
        assert main(["train", "--config", str(config)]) == 0
        assert [line for line in capsys.readouterr().err.splitlines() if "tested model families" in line] == notices
