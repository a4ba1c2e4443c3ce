"""The JSON API of `maximus ui` over real HTTP, with real child processes: start a tiny run, stop it
(SIGTERM: checkpoint, exit 75), resume it, and the adapter equals an uninterrupted run's bit for bit;
chat (greedy tuned column = `maximus generate`); export; and the safety rules (token, origin, roots,
code), under which a refused request starts, writes and deletes nothing."""
from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tiny import tiny_config, write_prompt_completion

TOKEN = "t0ken-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
STEPS = 6
# maximus-train with a pause after each backward, so that a stop lands mid-run (the trainer's own hook).
SLOW_TRAIN = """
import sys, time
from maximus.train import trainer as t
orig = t.Trainer.__init__
def slow_init(self, cfg, **kw):
    orig(self, cfg, hooks={"after_backward": lambda tr, step: time.sleep(0.4)}, **kw)
t.Trainer.__init__ = slow_init
from maximus.cli import train_main
sys.exit(train_main(sys.argv[1:]))
"""


class Api:
    """The app with a token, open reads and roots under tmp, served on a free loopback port."""

    def __init__(self, tmp: Path, **kw):
        from werkzeug.serving import make_server

        from maximus.ui.app import LOOPBACK_HOSTS, create_app
        from maximus.ui.guard import Roots

        self.runs, self.data, self.models = tmp / "runs", tmp / "data", tmp / "models"
        for d in (self.runs, self.data, self.models):
            d.mkdir(exist_ok=True)
        self.app = create_app(self.runs, token=TOKEN, open_reads=True, roots=Roots.of(self.data, self.models, self.runs),
                              allowed_hosts=LOOPBACK_HOSTS, **kw)
        self.httpd = make_server("127.0.0.1", 0, self.app, threaded=True)
        self.port = self.httpd.server_port
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def jobs(self):
        return self.app.extensions["maximus_jobs"]

    def call(self, method: str, path: str, body=None, headers: dict | None = None) -> tuple[int, dict | bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        raw = resp.read()
        conn.close()
        kind = resp.getheader("Content-Type", "")
        if kind.startswith("application/json"):
            return resp.status, json.loads(raw)
        if kind.startswith("application/x-ndjson"):
            return resp.status, [json.loads(line) for line in raw.decode().splitlines()]
        return resp.status, raw

    def post(self, path: str, body=None, headers: dict | None = None):
        return self.call("POST", path, body, {**AUTH, **(headers or {})})

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def api(tmp_path):
    a = Api(tmp_path, train_argv=[sys.executable, "-c", SLOW_TRAIN])
    yield a
    a.close()


def _cfg(api: Api, model: Path, name: str = "r1", **sections) -> dict:
    data = write_prompt_completion(api.data / "pc.jsonl")
    return tiny_config(model, data, api.runs / name, **{"training": {"max_steps": STEPS, "save_every": 2},
                                                       "eval": {"enabled": False}, **sections})


def _tree(root: Path) -> dict[str, int]:
    return {p.relative_to(root).as_posix(): p.stat().st_size for p in sorted(root.rglob("*"))}


def _adapter(run: Path) -> dict:
    return load_file(str(run / "adapter" / "adapter_model.safetensors"))


def _wait(cond, timeout=180, what="condition"):
    t0 = time.time()
    while not cond():
        assert time.time() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_start_stop_resume_equals_an_uninterrupted_run(api, tiny_model_dirs, tmp_path):
    import shutil

    from maximus import Config, Trainer

    model = Path(shutil.copytree(tiny_model_dirs["llama"], api.models / "llama"))
    cfg = _cfg(api, model)
    status, body = api.post("/api/runs", {"config": yaml.safe_dump(cfg)})
    assert (status, body) == (201, {"run": "r1"})
    run = api.runs / "r1"
    status, body = api.post("/api/runs", {"config": yaml.safe_dump(cfg)})  # one run per output dir
    assert status == 409 and body["error"].startswith(f"output_dir {run} is in use by a run")
    _wait(lambda: (run / "checkpoints" / "step-000002").is_dir(), what="the first checkpoint")
    status, info = api.call("GET", "/api/runs/r1")
    assert status == 200 and info["info"]["status"] == "running" and info["info"]["steps_done"] >= 2
    assert info["plan"]["method"] == "lora"
    assert api.post("/api/runs/r1/stop") == (202, {"run": "r1", "status": "stopping"})
    assert api.jobs.wait("train", "r1", timeout=120) == 75
    status, info = api.call("GET", "/api/runs/r1")
    assert info["info"]["status"] == "interrupted" and info["job"]["exit_code"] == 75
    stopped = info["info"]["steps_done"]
    assert stopped < STEPS and (run / "checkpoints" / f"step-{stopped:06d}").is_dir()
    assert f"stopped by SIGTERM after step {stopped}/{STEPS}" in info["job"]["log_tail"]
    assert api.post("/api/runs/r1/stop")[0] == 409  # not running
    assert api.post("/api/runs/r1/resume") == (202, {"run": "r1", "status": "starting"})
    assert api.jobs.wait("train", "r1", timeout=180) == 0
    status, info = api.call("GET", "/api/runs/r1")
    assert info["info"]["status"] == "finished" and info["info"]["steps_done"] == STEPS
    assert api.post("/api/runs/r1/resume")[0] == 409  # finished
    rows = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows == list(range(1, STEPS + 1))
    # The same config run uninterrupted, in this process: bit-equal adapter.
    ref = {**cfg, "output_dir": str(tmp_path / "ref")}
    Trainer(Config.from_dict(ref)).train()
    a, b = _adapter(run), _adapter(tmp_path / "ref")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    listed = {r["name"]: r for r in api.call("GET", "/api/runs")[1]}
    assert listed["r1"]["status"] == "finished" and listed["r1"]["exit_code"] == 0
