"""Bad input gives one line naming the problem, exit code 2, no traceback, and never touches an
earlier run's files."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from maximus.cli import main, train_main

from tiny import tiny_config


def _write_cfg(tmp_path: Path, cfg: dict) -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_cli_subprocess_exit_2_without_traceback(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model: m\ndataset: d\ntraining:\n  batch_sise: 2\n")
    proc = subprocess.run([sys.executable, "-m", "maximus.train", "--config", str(p)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: {p}: unknown key 'training.batch_sise' "
                                   "(hint: did you mean 'training.batch_size'?)")


def test_missing_config_file(tmp_path, capsys):
    assert train_main(["--config", str(tmp_path / "nope.yaml")]) == 2
    assert _err(capsys) == f"error: config file not found: {tmp_path / 'nope.yaml'} (hint: check the path passed to --config)"


def test_missing_model_dir(tmp_path, pc_data, capsys):
    cfg = tiny_config(tmp_path / "no-model", pc_data, tmp_path / "run")
    assert train_main(["--config", str(_write_cfg(tmp_path, cfg))]) == 2
    assert _err(capsys) == (f"error: model not found: {tmp_path / 'no-model'} "
                            "(hint: give a local model directory (with config.json) or a Hugging Face hub id)")
    assert not (tmp_path / "run").exists()


def test_missing_dataset(tiny_llama, tmp_path, capsys):
    cfg = tiny_config(tiny_llama, tmp_path / "missing.jsonl", tmp_path / "run")
    assert train_main(["--config", str(_write_cfg(tmp_path, cfg))]) == 2
    assert _err(capsys) == (f"error: dataset not found: {tmp_path / 'missing.jsonl'} "
                            "(hint: check the path (relative paths are resolved from the current directory))")


def test_malformed_line_names_file_and_line(tiny_llama, tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a", "completion": \n')
    cfg = tiny_config(tiny_llama, data, tmp_path / "run")
    assert train_main(["--config", str(_write_cfg(tmp_path, cfg))]) == 2
    line = _err(capsys)
    assert line.startswith(f"error: {data}:2: malformed JSON: ")
    assert line.endswith("(hint: fix the line, or set `on_error: skip` on the dataset to skip bad records)")


def test_unknown_method_and_bad_vram_via_override(tiny_llama, pc_data, tmp_path, capsys):
    p = _write_cfg(tmp_path, tiny_config(tiny_llama, pc_data, tmp_path / "run"))
    assert train_main(["--config", str(p), "method=qlorra"]) == 2
    assert _err(capsys) == (f"error: {p}: invalid value for 'method': 'qlorra': expected 'full', 'lora', 'qlora' or "
                            "'auto' (hint: see docs/config.md for allowed values)")
    assert train_main(["--config", str(p), "optimization.target_vram=lots"]) == 2
    assert _err(capsys).startswith(f"error: {p}: optimization.target_vram: cannot parse 'lots' as a memory size")


def test_empty_dataset_after_filtering(tiny_llama, tmp_path, capsys):
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    cfg = tiny_config(tiny_llama, data, tmp_path / "run")
    assert train_main(["--config", str(_write_cfg(tmp_path, cfg))]) == 2
    assert _err(capsys).startswith(f"error: dataset is empty after filtering: {data}")


def test_failed_start_leaves_earlier_run_untouched(tiny_llama, tmp_path, capsys):
    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    files = {run / "run.json": '{"old": true}', run / "metrics.jsonl": '{"step": 1, "loss": 1.0}\n',
             run / "adapter" / "adapter_config.json": "{}"}
    for f, text in files.items():
        f.write_text(text)
    data = tmp_path / "bad.jsonl"
    data.write_text("not json\n")
    cfg = tiny_config(tiny_llama, data, run)
    assert train_main(["--config", str(_write_cfg(tmp_path, cfg))]) == 2
    assert {f: f.read_text() for f in files} == files
    assert sorted(p.name for p in run.iterdir()) == ["adapter", "metrics.jsonl", "run.json"]


def test_pickle_only_model_refused(tmp_path, pc_data, capsys):
    model = tmp_path / "pickled"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (model / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    cfg = tiny_config(model, pc_data, tmp_path / "run")
    assert train_main(["--config", str(_write_cfg(tmp_path, cfg))]) == 2
    assert _err(capsys) == (f"error: model directory {model} holds only pickle weights (.bin/.pt), which can run code "
                            "when loaded (hint: convert them to safetensors, or set allow_pickle: true if you trust the files)")


def test_unknown_subcommand(capsys):
    assert main(["trian"]) == 2
    assert _err(capsys) == "error: unknown command 'trian' (hint: did you mean 'train'?)"


@pytest.mark.parametrize("argv, line", [
    (["eval"], "error: maximus eval: the following arguments are required: run_dir "
               "(hint: `maximus eval --help` lists the arguments)"),
    (["generate", "some-run"], "error: maximus generate: the following arguments are required: --prompt/-p "
                               "(hint: `maximus generate --help` lists the arguments)"),
    (["generate", "some-run", "-p", "hi", "--max-new-tokens", "many"],
     "error: maximus generate: argument --max-new-tokens: invalid int value: 'many' "
     "(hint: `maximus generate --help` lists the arguments)"),
    (["embed", "m", "--input", "t.txt"], "error: maximus embed: the following arguments are required: --out "
                                         "(hint: `maximus embed --help` lists the arguments)"),
    (["export", "run"], "error: maximus export: the following arguments are required: --out "
                        "(hint: `maximus export --help` lists the arguments)"),
    (["plan", "--bogus"], "error: maximus plan: unrecognized arguments: --bogus "
                          "(hint: `maximus plan --help` lists the arguments)"),
])
def test_command_line_mistakes_are_one_line_and_exit_2(argv, line, capsys):
    assert main(argv) == 2
    assert _err(capsys) == line


def test_train_without_config_is_one_line(capsys):
    assert train_main([]) == 2
    assert _err(capsys) == ("error: maximus-train: the following arguments are required: --config/-c "
                            "(hint: `maximus-train --help` lists the arguments)")


def test_eval_errors(tmp_path, capsys):
    assert main(["eval", str(tmp_path / "nope")]) == 2
    assert _err(capsys) == (f"error: {tmp_path / 'nope'} is not a finished Maximus run (no run.json) "
                            "(hint: pass the output_dir of a completed maximus-train run)")
    run = tmp_path / "embedder"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"config": {"model": "m", "dataset": "d", "objective": "contrastive"}}))
    assert main(["eval", str(run)]) == 2
    assert _err(capsys) == (f"error: maximus eval reports next-token loss, and {run} trained a contrastive embedding "
                            "model (hint: its held-out recall before/after is in run.json under eval; embed texts "
                            "with maximus embed)")


def test_generate_errors(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "no-model"), "-p", "hi"]) == 2
    assert _err(capsys) == (f"error: model not found: {tmp_path / 'no-model'} "
                            "(hint: give a local model directory (with config.json) or a Hugging Face hub id)")


def test_embed_errors(tmp_path, capsys):
    texts = tmp_path / "t.txt"
    texts.write_text("hello\n")
    assert main(["embed", str(tmp_path), "--input", str(texts), "--out", str(tmp_path / "v.npy")]) == 2
    assert _err(capsys) == (f"error: {tmp_path} is neither a Maximus run directory (run.json) nor a model directory "
                            "(config.json) (hint: pass a run's output_dir or a directory written by save_pretrained)")
    assert main(["embed", str(tmp_path), "--input", str(tmp_path / "t.csv"), "--out", str(tmp_path / "v.npy")]) == 2
    assert _err(capsys) == (f"error: input file {tmp_path / 't.csv'} not found "
                            "(hint: pass --input a .txt (one text per line) or .jsonl file)")
    assert not (tmp_path / "v.npy").exists()
