"""`maximus export --out` never destroys what it did not write: user files are refused untouched,
a previous export is replaced only with --overwrite, and a failed export leaves the old one intact."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from maximus.cli import main
from maximus.errors import ExportError
from maximus.export.target import MARKER, write_directory


def _snapshot(root: Path) -> dict[str, str]:
    """Every path under root (and root's siblings) with a content hash: what 'nothing touched' means."""
    out = {}
    for p in sorted(root.parent.rglob("*")):
        if root.parent in p.parents or p == root:
            key = p.relative_to(root.parent).as_posix()
            out[key] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    return out


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def _user_dir(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    (home / "projects" / "thesis").mkdir(parents=True)
    (home / "notes.txt").write_text("do not lose me")
    (home / "projects" / "thesis" / "draft.tex").write_text("\\section{Intro}")
    return home


@pytest.mark.parametrize("fmt", ["merged", "adapter"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_directory_with_user_files_is_refused_and_untouched(lora_run, tmp_path, capsys, fmt, overwrite):
    home = _user_dir(tmp_path)
    before = _snapshot(home)
    argv = ["export", str(lora_run), "--out", str(home), "--format", fmt] + (["--overwrite"] if overwrite else [])
    assert main(argv) == 2
    assert _err(capsys) == (f"error: --out {home} already exists and holds files no Maximus export wrote "
                            "(e.g. 'notes.txt') (hint: choose a new or empty directory; nothing was changed)")
    assert _snapshot(home) == before


def test_dot_as_out_is_refused(lora_run, tmp_path, capsys, monkeypatch):
    project = _user_dir(tmp_path)
    monkeypatch.chdir(project)
    before = _snapshot(project)
    assert main(["export", str(lora_run), "--out", ".", "--overwrite"]) == 2
    assert _err(capsys) == ("error: --out . already exists and holds files no Maximus export wrote (e.g. 'notes.txt') "
                            "(hint: choose a new or empty directory; nothing was changed)")
    assert _snapshot(project) == before


def test_existing_file_is_refused(lora_run, tmp_path, capsys):
    target = tmp_path / "model.bin"
    target.write_bytes(b"\x00weights")
    assert main(["export", str(lora_run), "--out", str(target)]) == 2
    assert _err(capsys) == (f"error: --out {target} exists and is not a directory "
                            "(hint: choose a new or empty directory; nothing was changed)")
    assert target.read_bytes() == b"\x00weights"


def test_previous_export_needs_overwrite_then_is_replaced(lora_run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "exports" / "merged"
    assert main(["export", str(lora_run), "--out", str(out), "--dtype", "bf16"]) == 0
    marker = json.loads((out / MARKER).read_text())
    assert marker["format"] == "merged" and marker["dtype"] == "bf16"
    assert set(marker["files"]) == {p.name for p in out.iterdir()} - {MARKER}
    assert "model.safetensors" in marker["files"]
    first = _snapshot(out)
    capsys.readouterr()

    assert main(["export", str(lora_run), "--out", str(out)]) == 2
    assert _err(capsys) == f"error: --out {out} holds a previous export (hint: pass --overwrite to replace it)"
    assert _snapshot(out) == first

    assert main(["export", str(lora_run), "--out", str(out), "--overwrite"]) == 0
    assert json.loads((out / MARKER).read_text())["dtype"] == "fp32"
    assert AutoModelForCausalLM.from_pretrained(str(out)).dtype == torch.float32
    assert sorted(p.name for p in out.parent.iterdir()) == ["merged"]  # no temporary or old copy left behind


def test_overwrite_refuses_a_previous_export_the_user_added_to(lora_run, tmp_path, capsys):
    out = tmp_path / "adapter-export"
    assert main(["export", str(lora_run), "--out", str(out), "--format", "adapter"]) == 0
    (out / "my-eval-results.json").write_text("{}")
    before = _snapshot(out)
    capsys.readouterr()
    assert main(["export", str(lora_run), "--out", str(out), "--format", "adapter", "--overwrite"]) == 2
    assert _err(capsys) == (f"error: --out {out} holds a previous export plus files it did not write "
                            "(e.g. 'my-eval-results.json') (hint: move them away or choose another directory; "
                            "nothing was changed)")
    assert _snapshot(out) == before


def test_empty_directory_is_used(lora_run, tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    assert main(["export", str(lora_run), "--out", str(out), "--format", "adapter"]) == 0
    assert (out / "adapter_model.safetensors").is_file() and (out / MARKER).is_file()
    assert oct(out.stat().st_mode & 0o777) == oct(0o755)


def test_failed_export_leaves_previous_export_intact(tmp_path):
    out = tmp_path / "out"
    write_directory(out, lambda d: (d / "a.txt").write_text("first"), overwrite=False, meta={"format": "test"})
    before = _snapshot(out)

    def broken(d: Path) -> None:
        (d / "a.txt").write_text("half written")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_directory(out, broken, overwrite=True, meta={"format": "test"})
    assert _snapshot(out) == before
    assert os.listdir(tmp_path) == ["out"]


def test_unreadable_marker_is_not_trusted(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / MARKER).write_text("not json")
    (out / "weights.safetensors").write_text("x")
    with pytest.raises(ExportError) as info:
        write_directory(out, lambda d: None, overwrite=True, meta={})
    assert str(info.value) == (f"--out {out} has an unreadable {MARKER} "
                               "(hint: choose a new or empty directory; nothing was changed)")
    assert (out / "weights.safetensors").read_text() == "x"


def test_adapter_export_loads_in_peft_with_the_run_logits(lora_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from maximus.export import load_tuned, run_config

    out = tmp_path / "adapter"
    assert main(["export", str(lora_run), "--out", str(out), "--format", "adapter"]) == 0
    readme = (out / "README.md").read_text()
    base_dir = run_config(lora_run).model
    assert f"# LoRA adapter for `{base_dir}`" in readme
    assert f"vllm serve {base_dir} --enable-lora --max-lora-rank 8 --lora-modules adapter={out}" in readme
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    exported = PeftModel.from_pretrained(base, str(out)).eval()
    tuned, _ = load_tuned(lora_run)
    ids = torch.arange(3, 19).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ids).logits, tuned(input_ids=ids).logits, rtol=0, atol=0)


def test_adapter_export_of_a_full_fine_tune_is_refused(lora_run, tmp_path, capsys):
    full = tmp_path / "full-run"
    (full / "model").mkdir(parents=True)
    (full / "run.json").write_text((lora_run / "run.json").read_text())
    assert main(["export", str(full), "--out", str(tmp_path / "a"), "--format", "adapter"]) == 2
    assert _err(capsys) == (f"error: {full} is a full fine-tune: it has no adapter to export "
                            "(hint: use --format merged (or gguf / ollama))")
    assert not (tmp_path / "a").exists()
