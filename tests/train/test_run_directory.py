"""`maximus-train` deletes nothing it did not write: an `output_dir` someone else filled is refused
at the start, untouched; a run of ours resumes; a file a person put into a run's `adapter/` or a
checkpoint is kept and named."""
from __future__ import annotations

import hashlib
import json

import pytest
import yaml

from maximus.cli import main
from maximus.train.run_directory import MARKER
from tiny import tiny_config


def _snapshot(root) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def _config(tmp_path, tiny_llama, pc_data, out, **sections) -> str:
    cfg = tiny_config(tiny_llama, pc_data, out, **{"training": {"max_steps": 1}, "eval": {"enabled": False}, **sections})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _err(capsys) -> str:
    """The one error line (a run that loaded its data has printed the data check before it)."""
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1, err
    return err[0]


def test_a_folder_holding_user_files_is_refused_untouched(tmp_path, tiny_llama, pc_data, capsys):
    od = tmp_path / "od"
    (od / "adapter").mkdir(parents=True)
    (od / "adapter" / "notes.txt").write_text("notes")
    before = _snapshot(od)
    assert main(["train", "--config", _config(tmp_path, tiny_llama, pc_data, od)]) == 2
    assert _err(capsys) == (f"error: output_dir {od} already exists and holds files no Maximus run wrote (e.g. 'adapter') "
                            "(hint: choose a new or empty directory; nothing was changed)")
    assert _snapshot(od) == before


def test_output_dir_dot_beside_a_base_model_is_refused(tmp_path, tiny_llama, pc_data, capsys, monkeypatch):
    """`output_dir: .` in a project whose base model sits at ./model: a full fine-tune would have
    replaced ./model with its own."""
    project = tmp_path / "project"
    (project / "model").mkdir(parents=True)
    (project / "model" / "config.json").write_text("{}")
    monkeypatch.chdir(project)
    before = _snapshot(project)
    assert main(["train", "--config", _config(tmp_path, tiny_llama, pc_data, ".", method="full")]) == 2
    assert _err(capsys) == ("error: output_dir . already exists and holds files no Maximus run wrote (e.g. 'model') "
                            "(hint: choose a new or empty directory; nothing was changed)")
    assert _snapshot(project) == before


def test_a_run_of_ours_resumes_and_a_file_added_to_its_adapter_is_kept(tmp_path, tiny_llama, pc_data, capsys):
    od = tmp_path / "od"
    od.mkdir()  # empty: allowed
    config = _config(tmp_path, tiny_llama, pc_data, od)
    assert main(["train", "--config", config]) == 0
    marker = json.loads((od / MARKER).read_text())
    assert marker["written_by"] == "maximus-train"
    assert marker["final_weights"]["adapter"] == sorted(p.name for p in (od / "adapter").iterdir())
    assert main(["train", "--config", config]) == 0  # a run of ours: it resumes (at its last step) and saves again
    assert len((od / "metrics.jsonl").read_text().splitlines()) == 1  # no step trained twice
    capsys.readouterr()
    (od / "adapter" / "notes.txt").write_text("notes")
    assert main(["train", "--config", config]) == 2
    assert _err(capsys) == (f"error: {od / 'adapter'} holds files this run did not write (e.g. 'notes.txt'); the final "
                            f"weights were not saved (hint: move them out of {od / 'adapter'} and run again: the run "
                            "resumes from its last checkpoint and saves them)")
    assert (od / "adapter" / "notes.txt").read_text() == "notes"
    assert sorted(p.name for p in od.iterdir() if p.name.startswith(".adapter")) == []  # its temporary is gone


def test_checkpoints_a_person_added_files_to_are_kept(tmp_path, tiny_llama, pc_data, capsys):
    od = tmp_path / "od"
    config = _config(tmp_path, tiny_llama, pc_data, od, training={"max_steps": 3, "save_every": 1, "keep_checkpoints": 1})
    step1 = od / "checkpoints" / "step-000001"
    assert main(["train", "--config", config, "training.max_steps=1"]) == 0
    (step1 / "mine.txt").write_text("mine")
    assert main(["train", "--config", config]) == 0  # steps 2 and 3 prune step 1: not with a file of a person's
    assert (step1 / "mine.txt").read_text() == "mine"
    assert sorted(p.name for p in (od / "checkpoints").iterdir()) == ["step-000001", "step-000003"]
