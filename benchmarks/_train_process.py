"""One real `maximus-train` process for the benchmarks: a config dict in, its run.json out.

    from _train_process import train_process
    run = train_process(cfg, out_dir)     # run.json as a dict, or {"error": last line of stderr}
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def train_process(cfg: dict, out: Path) -> dict:
    """Write `cfg` beside `out` as YAML and train it with the maximus-train entry point in this
    interpreter (PYTHONPATH picks the checkout); run.json, or {"error": ...} on a non-zero exit."""
    import yaml

    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    entry = [sys.executable, "-c", "from maximus.cli import train_entry; train_entry()"]
    proc = subprocess.run([*entry, "--config", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return {"error": lines[-1] if lines else f"exit {proc.returncode}"}
    return json.loads((out / "run.json").read_text())
