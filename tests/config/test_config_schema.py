"""The config contract: the seed's YAML runs as written, bad input gives one exact line."""
from pathlib import Path

import pytest

from maximus.config import Config, parse_bytes, schema_markdown
from maximus.errors import ConfigError
from tiny import ARTICLE_YAML

SEED = ARTICLE_YAML


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_seed_config_validates_as_written(tmp_path):
    cfg = Config.from_yaml(_write(tmp_path, SEED))
    assert cfg.optimization.target_vram == 16 * 10**9
    assert cfg.optimization.use_ghost_logit is True
    assert cfg.optimization.kronecker.detail_tokens == 256
    assert cfg.training.batch_size == 4 and cfg.training.epochs == 3
    assert [d.path for d in cfg.datasets] == ["my_dataset"]
    assert cfg.output_dir == "runs/Mistral-12B-v0.1"


@pytest.mark.parametrize("text,expected", [
    ("16GB", 16 * 10**9), ("16 GiB", 16 * 2**30), ("16000MB", 16 * 10**9), (1234, 1234),
    ("auto", "auto"), (None, None), ("T4", 15 * 2**30), ("a100-40gb", 39 * 2**30), ("1.5e9", 1_500_000_000),
])
def test_target_vram_forms(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("data,message", [
    ({"model": "m", "dataset": "d", "trainig": {}},
     "config: unknown key 'trainig' (hint: did you mean 'training'?)"),
    ({"model": "m", "dataset": "d", "training": {"batch_sise": 2}},
     "config: unknown key 'training.batch_sise' (hint: did you mean 'training.batch_size'?)"),
    ({"model": "m", "dataset": [{"path": "a", "fromat": "text"}]},
     "config: unknown key 'dataset.0.fromat' (hint: did you mean 'dataset.0.format'?)"),
    ({"model": "m", "dataset": "d", "training": {"batch_size": "four"}},
     "config: invalid value for 'training.batch_size': 'four': expected a valid integer, unable to parse string as an"
     " integer (hint: see docs/config.md for allowed values)"),
    ({"model": "m", "dataset": "d", "method": "qlorra"},
     "config: invalid value for 'method': 'qlorra': expected 'full', 'lora', 'qlora' or 'auto' (hint: see docs/config.md"
     " for allowed values)"),
    ({"model": "m", "dataset": "d", "optimization": {"target_vram": "16 bananas"}},
     "config: optimization.target_vram: cannot parse '16 bananas' as a memory size (hint: write e.g. 16GB, 16 GiB,"
     " 16000MB, a number of bytes, auto, or a card name (T4, L4, A10, RTX3090, RTX4090, A100-40GB, A100-80GB, H100, H200))"),
    ({"dataset": "d"}, "config: missing required key 'model' (hint: see docs/config.md for every key)"),
])
def test_bad_config_one_line(data, message):
    with pytest.raises(ConfigError) as err:
        Config.from_dict(data)
    assert err.value.one_line() == message


def test_yaml_syntax_error_names_line(tmp_path):
    p = _write(tmp_path, "model: m\ndataset: d\ntraining:\n  batch_size: [1, 2\n")
    with pytest.raises(ConfigError) as err:
        Config.from_yaml(p)
    assert err.value.one_line() == (f"{p}:5:1: YAML syntax error: expected ',' or ']', but got '<stream end>' "
                                    "(hint: check indentation and quoting on that line)")


def test_overrides_are_validated(tmp_path):
    p = _write(tmp_path, "model: m\ndataset: d\n")
    cfg = Config.from_yaml(p, ["training.max_steps=7", "optimization.kronecker_sketching.block=32", "lora.r=4"])
    assert cfg.training.max_steps == 7 and cfg.optimization.kronecker.block == 32 and cfg.lora.r == 4
    with pytest.raises(ConfigError) as err:
        Config.from_yaml(p, ["training.max_step=7"])
    assert "did you mean 'training.max_steps'?" in err.value.one_line()
    with pytest.raises(ConfigError) as err:
        Config.from_yaml(p, ["training.max_steps"])
    assert err.value.one_line() == ("override 'training.max_steps' is not of the form key.sub=value "
                                    "(hint: e.g. training.max_steps=10)")


def test_docs_config_md_is_generated_from_schema():
    doc = Path(__file__).resolve().parents[2] / "docs" / "config.md"
    assert doc.read_text() == schema_markdown(), "run: python -m maximus.config > docs/config.md"


def test_every_key_is_documented():
    text = schema_markdown()
    for key in ("optimization.target_vram", "training.micro_batch_size", "lora.use_dora", "eval.prompts",
                "optimization.offload.activations", "dpo.beta", "optimization.kronecker_sketching"):
        assert f"| `{key}` |" in text
    assert "|  |" not in text  # no key without a description


@pytest.mark.parametrize("word, checkpointing, offload", [("off", "none", "off"), ("false", "none", "off"),
                                                         ("no", "none", "off"), ("on", "full", "on"),
                                                         ("true", "full", "on"), ("'off'", "none", "off"),
                                                         ("none", "none", "off")])
def test_unquoted_yaml_switches_read_as_the_words_written(tmp_path, word, checkpointing, offload):
    # YAML 1.1 turns unquoted off / on into False / True: gradient_checkpointing False -> none (and
    # `off`, its former word, too), True -> full; the offload switches False -> off, True -> on.
    offload_word = "off" if word == "none" else word  # the offload switches are on / off
    cfg = Config.from_yaml(_write(tmp_path, f"model: m\ndataset: d\noptimization:\n  gradient_checkpointing: {word}\n"
                                            f"  offload:\n    activations: {offload_word}\n    optimizer: {offload_word}\n"))
    assert cfg.optimization.gradient_checkpointing == checkpointing
    assert (cfg.optimization.offload.activations, cfg.optimization.offload.optimizer) == (offload, offload)
