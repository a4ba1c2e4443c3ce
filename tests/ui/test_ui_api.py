"""The JSON API of `maximus ui` over real HTTP, with real child processes: start a tiny run, stop it
(SIGTERM: checkpoint, exit 75), resume it, and the adapter equals an uninterrupted run's bit for bit;
chat (greedy tuned column = `maximus generate`); export; and the safety rules (token, origin, roots,
code), under which a refused request starts, writes and deletes nothing."""
from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
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
# maximus-train with a pause after each backward (1.5 s: at 0.4 s a quiet machine finished all steps
# before the page's stop arrived), so that a stop lands mid-run (the trainer's own hook).
SLOW_TRAIN = """
import sys, time
from maximus.train import trainer as t
orig = t.Trainer.__init__
def slow_init(self, cfg, **kw):
    orig(self, cfg, hooks={"after_backward": lambda tr, step: time.sleep(1.5)}, **kw)
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
            d.mkdir(parents=True, exist_ok=True)
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
    a = Api(tmp_path, train_argv=[sys.executable, "-c", SLOW_TRAIN], slots=1)
    yield a
    a.close()


def _cfg(api: Api, model: Path, name: str = "r1", **sections) -> dict:
    data = write_prompt_completion(api.data / "pc.jsonl")
    return tiny_config(model, data, api.runs / name, **{"training": {"max_steps": STEPS, "save_every": 2},
                                                       "eval": {"enabled": False}, **sections})


def _in_use(run: Path, owner: str) -> str:
    """The output-dir lock's own line (`maximus.train.lock`), which the server answers too."""
    return (f"output_dir {run} is in use by another run ({owner}) "
            "(hint: wait for it to finish, stop it, or choose another output_dir)")


def _tree(root: Path) -> dict[str, int]:
    return {p.relative_to(root).as_posix(): p.stat().st_size for p in sorted(root.rglob("*"))}


def _adapter(run: Path) -> dict:
    return load_file(str(run / "adapter" / "adapter_model.safetensors"))


def _wait(cond, timeout=180, what="condition"):
    t0 = time.time()
    while not cond():
        assert time.time() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.05)


BROWSER = shutil.which("chromium") and shutil.which("chromedriver")


@pytest.mark.skipif(bool(BROWSER) or os.environ.get("CI") == "true",
                    reason="the browser test (test_ui.py::test_train_stop_resume_chat_export_from_the_pages) runs this "
                           "flow through the same API; this one covers it where no browser is installed")
def test_start_stop_resume_equals_an_uninterrupted_run(api, tiny_model_dirs, tmp_path):
    import shutil

    from maximus import Config, Trainer

    model = Path(shutil.copytree(tiny_model_dirs["llama"], api.models / "llama"))
    cfg = _cfg(api, model)
    status, body = api.post("/api/runs", {"config": yaml.safe_dump(cfg)})
    assert (status, body) == (201, {"run": "r1", "status": "starting"})
    run = api.runs / "r1"
    status, body = api.post("/api/runs", {"config": yaml.safe_dump(cfg)})  # one run per output dir
    assert (status, body["error"]) == (409, _in_use(run, f"pid {api.jobs.record('train', 'r1')['pid']}"))
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


def test_the_queue_starts_runs_in_order_as_slots_free_and_cancels(api, tiny_model_dirs):
    """One slot (a CPU): a second and a third start wait as `queued` in order, the second is
    cancelled (token needed), the third starts by itself when the first ends, and the queue is on
    disk for a server started again. One real run trains (1 step); the third is stopped as soon as
    it starts (SIGTERM while it loads), so the test costs one run."""
    from maximus.ui.jobs import Jobs

    model = Path(shutil.copytree(tiny_model_dirs["llama"], api.models / "llama"))
    cfgs = {n: _cfg(api, model, n, training={"max_steps": steps, "save_every": 2}) for n, steps in
            (("qa", 1), ("qb", 1), ("qc", 1))}
    start = lambda n: api.post("/api/runs", {"config": yaml.safe_dump(cfgs[n])})  # noqa: E731
    assert start("qa") == (201, {"run": "qa", "status": "starting"})
    assert start("qb") == (201, {"run": "qb", "status": "queued", "queue_position": 1})
    assert start("qc") == (201, {"run": "qc", "status": "queued", "queue_position": 2})
    # One run per output dir, running or queued: the lock's line.
    pid = api.jobs.record("train", "qa")["pid"]
    assert start("qa") == (409, {"error": _in_use(api.runs / "qa", f"pid {pid}"), "key": "output_dir"})
    assert start("qb") == (409, {"error": _in_use(api.runs / "qb", "run qb, queued at position 1"), "key": "output_dir"})
    listed = {r["name"]: r for r in api.call("GET", "/api/runs")[1]}
    assert listed["qa"]["status"] in ("starting", "running") and listed["qa"]["queue_position"] is None
    assert [(listed[n]["status"], listed[n]["queue_position"]) for n in ("qb", "qc")] == [("queued", 1), ("queued", 2)]
    status, info = api.call("GET", "/api/runs/qb")
    assert status == 200 and (info["info"]["status"], info["info"]["queue_position"]) == ("queued", 1)
    assert info["config"]["output_dir"] == str(api.runs / "qb") and info["job"] is None
    assert b"Cancel</button>" in api.call("GET", "/runs")[1]
    # A resume waits in the queue too; cancelled, the run is as it was (an interrupted one, made by hand).
    stopped = api.runs / "qi"
    (stopped / "checkpoints" / "step-000001").mkdir(parents=True)
    (stopped / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    (stopped / "plan.json").write_text(json.dumps({"config": _cfg(api, model, "qi")}))
    assert api.post("/api/runs/qi/resume") == (202, {"run": "qi", "status": "queued", "queue_position": 3})
    assert api.post("/api/runs/qi/resume") == (409, {"error": "run qi is queued (hint: it starts when a slot frees; "
                                                              "or cancel it)"})
    assert api.post("/api/runs/qi/cancel") == (200, {"run": "qi", "status": "cancelled"})
    assert api.call("GET", "/api/runs/qi")[1]["info"]["status"] == "interrupted"
    # Cancel: token and origin checked like every POST; only a queued run.
    for headers in ({"Authorization": ""}, {"Origin": "http://evil.example"}):
        assert api.post("/api/runs/qb/cancel", {}, headers)[0] == 403
    assert api.jobs.queued() == ["qb", "qc"]
    assert api.post("/api/runs/qc/stop") == (409, {"error": "run qc is queued, not running "
                                                             "(hint: cancel it: POST /api/runs/qc/cancel)"})
    assert api.post("/api/runs/qb/cancel") == (200, {"run": "qb", "status": "cancelled"})
    assert api.post("/api/runs/qb/cancel")[0] == 404  # a cancelled new run is gone
    assert api.post("/api/runs/qa/cancel") == (409, {"error": "run qa is not queued (hint: only a queued run can be "
                                                             "cancelled; stop a running one)"})
    assert api.call("GET", "/api/runs/qc")[1]["info"]["queue_position"] == 1
    # The queue lives on disk: a server started again on these runs sees it and the live child.
    again = Jobs(api.runs, admit=api.app.extensions["maximus"].guard.confinement.saved_run)
    assert again.queued() == ["qc"] and again.running() == ["qa"] and again.status("qc", "failed") == "queued"
    # qa ends: qc starts by itself (and is stopped while it loads, before the trainer's handler); qb never does.
    assert api.jobs.wait("train", "qa", timeout=240) == 0
    _wait(lambda: ("train", "qc") in api.jobs._procs, what="the queued run to start")
    assert api.post("/api/runs/qc/stop") == (202, {"run": "qc", "status": "stopping"})
    assert api.jobs.queued() == [] and json.loads((api.runs / ".maximus-ui" / ".queue.json").read_text()) == {"queue": []}
    assert api.jobs.wait("train", "qc", timeout=60) == -signal.SIGTERM
    listed = {r["name"]: r for r in api.call("GET", "/api/runs")[1]}
    assert {n: (r["status"], r["exit_code"]) for n, r in listed.items()} == {
        "qa": ("finished", 0), "qc": ("failed", -signal.SIGTERM), "qi": ("interrupted", None)}
    assert not (api.runs / "qb").exists() and ("train", "qb") not in api.jobs._procs


def test_a_restarted_server_rechecks_every_saved_queue_entry(tmp_path):
    """A queue file an earlier server left (one started with --allow-code or other roots, or an
    edited file) is checked entry by entry with this server's flags, as a posted config is: an
    entry the guard refuses leaves the queue, never starts, writes nothing outside --runs, and
    shows as refused with the guard's line."""
    runs, data, models = tmp_path / "runs", tmp_path / "data", tmp_path / "models"
    (models / "m").mkdir(parents=True)
    data.mkdir()
    pc = write_prompt_completion(data / "pc.jsonl")
    outside = tmp_path / "outside"

    def entry(name, run_dir, **change):
        return {"name": name, "run_dir": str(run_dir), "resume": False, "queued": 0.0,
                "config": {**tiny_config(models / "m", pc, run_dir), **change}}

    saved = [entry("code", runs / "code", trust_remote_code=True), entry("passwd", runs / "passwd", dataset="/etc/passwd"),
             entry("outside", outside), entry("renamed", runs / "elsewhere"), {"name": 3}, entry("../x", runs / "x"),
             entry("ok", runs / "ok")]
    saved[3]["run_dir"] = str(runs / "renamed")
    (runs / ".maximus-ui").mkdir(parents=True)
    (runs / ".maximus-ui" / ".queue.json").write_text(json.dumps({"queue": saved}))
    api = Api(tmp_path, train_argv=[sys.executable, "-c", "pass"], slots=1)
    try:
        assert api.jobs.wait("train", "ok", timeout=60) == 0
        assert set(api.jobs._procs) == {("train", "ok")}  # the only entry the guard lets through
        assert json.loads((runs / ".maximus-ui" / ".queue.json").read_text()) == {"queue": []}
        assert not outside.exists() and not (tmp_path / "x").exists()
        listed = {r["name"]: r["status"] for r in api.call("GET", "/api/runs")[1]}
        assert listed == {"code": "refused", "passwd": "refused", "outside": "refused", "renamed": "refused",
                          "ok": "failed"}  # ok: `python -c pass` wrote no run files
        lines = {n: api.call("GET", f"/api/runs/{n}")[1]["job"]["log_tail"] for n in ("code", "passwd", "outside", "renamed")}
        assert lines == {
            "code": "refused: trust_remote_code: model code from the hub is code, and this server does not run code from "
                    "the browser (hint: start maximus ui with --allow-code if you trust every page that can reach it, "
                    "or run this config with maximus-train)\n",
            "passwd": f"refused: dataset /etc/passwd is outside --data-root {data} (hint: put it under {data}, or start "
                      "maximus ui with --data-root pointing at its folder)\n",
            "outside": f"refused: output_dir {outside} is outside --runs {runs} (hint: put it under {runs}, or start "
                       "maximus ui with --runs pointing at its folder)\n",
            "renamed": f"refused: queued run renamed waits for {runs / 'renamed'}, but its config writes output_dir "
                       f"{runs / 'elsewhere'} (hint: start it again from the run form)\n"}
        assert not (runs / "elsewhere").exists()
    finally:
        api.close()


def _finished_run(api: Api, model: Path, name: str = "done") -> Path:
    d = api.runs / name
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    (d / "run.json").write_text(json.dumps({"config": {"model": str(model), "dataset": "x"}, "steps": 1}))
    return d


def test_every_mutating_endpoint_refuses_and_changes_nothing(api, tiny_llama, tmp_path):
    (tmp_path / "outside").mkdir()
    secret_data = write_prompt_completion(tmp_path / "outside" / "secret.jsonl")
    (api.data / "link-out.jsonl").symlink_to(secret_data)
    model = api.models / "m"
    model.mkdir()
    _finished_run(api, model)
    good = _cfg(api, model, "new")
    bodies = {"/api/runs": {"config": yaml.safe_dump(good)}, "/api/check": {"config": yaml.safe_dump(good)},
              "/api/runs/<path:run>/stop": {}, "/api/runs/<path:run>/resume": {}, "/api/runs/<path:run>/cancel": {},
              "/api/runs/<path:run>/export": {"format": "adapter"},
              "/api/chat": {"run": "done", "messages": [{"role": "user", "content": "hi"}]}}
    assert _mutating_rules(api.app) == set(bodies)  # a new mutating route is refused here too
    endpoints = [(rule.replace("<path:run>", "done"), body) for rule, body in bodies.items()]
    before = _tree(tmp_path)
    refusals = []
    for path, body in endpoints:
        for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"},
                        {"Origin": "http://evil.example"}, {"Origin": f"http://localhost:{api.port}"},
                        {"Sec-Fetch-Site": "cross-site"}, {"Host": f"evil.example:{api.port}"}):
            status, answer = api.post(path, body, headers)
            assert status == 403, (path, headers, status, answer)
            refusals.append(answer["error"])
    assert refusals[:6] == [
        "a mutating request needs the token (hint: send Authorization: Bearer TOKEN, or open the ?token= URL maximus ui printed)",
        "a mutating request needs the token (hint: send Authorization: Bearer TOKEN, or open the ?token= URL maximus ui printed)",
        "a request from http://evil.example is not from this server's pages (hint: use the pages maximus ui serves, "
        "or send no Origin (curl, scripts))",
        f"a request from http://localhost:{api.port} is not from this server's pages (hint: use the pages maximus ui "
        "serves, or send no Origin (curl, scripts))",
        "a cross-site request is not from this server's pages (hint: use the pages maximus ui serves)",
        f"Host 'evil.example:{api.port}' is not this server (hint: open the URL maximus ui printed)"]
    # DNS rebinding: reads are open on loopback, but only under a loopback Host.
    assert api.call("GET", "/api/runs", headers={"Host": f"evil.example:{api.port}"})[0] == 403
    assert api.call("GET", "/api/runs")[0] == 200

    # Paths outside the roots, and code, with a valid token: refused with the rule broken.
    outside = str(tmp_path / "outside")
    cases = {
        "dataset": ({"dataset": {"path": str(secret_data), "format": "prompt_completion"}},
                    f"dataset.path {secret_data} is outside --data-root {api.data}"),
        "dataset link": ({"dataset": str(api.data / "link-out.jsonl")},
                         f"dataset {api.data / 'link-out.jsonl'} is outside --data-root {api.data}"),
        "dotdot": ({"dataset": str(api.data / ".." / "outside" / "secret.jsonl")},
                   f"dataset {api.data / '..' / 'outside' / 'secret.jsonl'} is outside --data-root {api.data}"),
        "eval.dataset": ({"eval": {"dataset": str(secret_data)}},
                         f"eval.dataset {secret_data} is outside --data-root {api.data}"),
        "metric": ({"eval": {"metrics": [f"{outside}/m.py:score"]}},
                   f"eval.metrics: the custom metric '{outside}/m.py:score' is code"),
        "model": ({"model": str(tiny_llama)}, f"model {tiny_llama} is outside --models-root {api.models}"),
        "tokenizer": ({"tokenizer": outside}, f"tokenizer {outside} is outside --models-root {api.models}"),
        "init_adapter": ({"init_adapter": outside},
                         f"init_adapter {outside} is outside --models-root {api.models} or --runs {api.runs}"),
        "output_dir": ({"output_dir": outside}, f"output_dir {outside} is outside --runs {api.runs}"),
        "prompt image": ({"eval": {"prompts": ["text only", {"text": "colour?", "image": f"{outside}/red.png"}]}},
                         f"eval.prompts image {outside}/red.png is outside --data-root {api.data}"),
        "image_root": ({"vision": {"image_root": outside}}, f"vision.image_root {outside} is outside --data-root {api.data}"),
        "runs itself": ({"output_dir": str(api.runs)}, f"output_dir {api.runs} is --runs itself"),
        "trust_remote_code": ({"trust_remote_code": True},
                              "trust_remote_code: model code from the hub is code, and this server does not run code "
                              "from the browser"),
        "pickle": ({"allow_pickle": True}, "allow_pickle: unpickling .bin / .pt weights is code"),
        "reward": ({"objective": "grpo", "grpo": {"rewards": [f"{outside}/r.py:score"]},
                    "dataset": {"path": str(api.data / "pc.jsonl"), "format": "prompt"}},
                   f"grpo.rewards: the reward '{outside}/r.py:score' is code"),
        "mlflow": ({"logging": {"mlflow": True, "mlflow_uri": f"sqlite:///{outside}/x.db"}},
                   "logging.mlflow_uri is not accepted from the browser"),
    }
    for case, (change, message) in cases.items():
        cfg = {**good, **change}
        for path in ("/api/runs", "/api/check"):
            status, answer = api.post(path, {"config": yaml.safe_dump(cfg)})
            assert status == 403 and answer["error"].startswith(message), (case, answer)
    status, answer = api.post("/api/runs", {"config": "model: [unclosed"})
    assert (status, answer) == (400, {"error": "config:1:17: YAML syntax error: expected ',' or ']', but got '<stream end>' "
                                                "(hint: check indentation and quoting on that line)"})
    status, answer = api.post("/api/runs", {"config": yaml.safe_dump({**good, "training": {"max_stepz": 3}})})
    assert (status, answer) == (400, {"error": "config: unknown key 'training.max_stepz' (hint: did you mean "
                                                "'training.max_steps'?)", "key": "training.max_stepz"})
    status, answer = api.post("/api/runs", {"config": "!!python/object/apply:os.system ['touch pwned']"})
    assert status == 400 and not list(Path.cwd().glob("pwned"))
    assert _tree(tmp_path) == before  # nothing written, nothing deleted
    assert api.jobs._procs == {}  # nothing started
    # --allow-code lets code keys through the guard (the plan still runs).
    code = Api(tmp_path / "code", allow_code=True)
    try:
        import shutil

        copied = Path(shutil.copytree(tiny_llama, code.models / "llama"))
        status, answer = code.post("/api/check", {"config": yaml.safe_dump({**_cfg(code, copied, "c"),
                                                                              "trust_remote_code": True})})
        assert status == 200 and answer["run"] == "c" and answer["plan"]["peak_bytes"] > 0
        # The images data rows name are read by the child: its config confines them to --data-root.
        assert answer["config"]["vision"] == {"image_root": str(code.data)}
    finally:
        code.close()


def _mutating_rules(app) -> set[str]:
    from maximus.ui.guard import UNGUARDED_POSTS

    return {r.rule for r in app.url_map.iter_rules()
            if "POST" in r.methods and r.rule.startswith("/api/") and r.rule not in UNGUARDED_POSTS}


def test_every_route_is_behind_the_one_guard(tmp_path):
    """Routes name a run only as `<path:run>`, which the guard confines before the route runs, and
    every POST but planning is under /api/, where the guard asks for the token."""
    from maximus.ui.app import create_app
    from maximus.ui.guard import UNGUARDED_POSTS

    app = create_app(tmp_path / "runs", token=TOKEN)
    variables = {(r.rule, name, type(conv).__name__) for r in app.url_map.iter_rules()
                 for name, conv in r._converters.items()}
    assert {v for v in variables if v[1] != "run"} == {("/static/<path:filename>", "filename", "PathConverter"),
                                                      ("/runs/<path:run>/exports/<export_id>", "export_id",
                                                       "UnicodeConverter")}
    assert {conv for _, name, conv in variables if name == "run"} == {"PathConverter"}
    posts = {r.rule for r in app.url_map.iter_rules() if "POST" in r.methods}
    assert posts - _mutating_rules(app) == {"/", "/api/plan"} == UNGUARDED_POSTS | {"/"}  # the planner: plans only


def test_the_planner_reads_models_under_models_root_only(tmp_path, tiny_llama):
    """Planning needs no token, so the model directory it reads is confined like a posted config's."""
    from urllib.parse import quote

    api = Api(tmp_path)
    try:
        inside = Path(shutil.copytree(tiny_llama, api.models / "llama"))
        status, report = api.call("GET", f"/api/plan?model_dir={quote(str(inside))}&seq=64&batch=1")
        assert status == 200 and report["model"] == str(inside)
        assert api.call("GET", "/api/plan?model=meta-llama/Llama-3.1-8B&seq=64&batch=1")[0] == 200  # a hub id
        for key in ("model_dir", "model"):
            line = (f"{key} {tiny_llama} is outside --models-root {api.models} (hint: put it under {api.models}, "
                    "or start maximus ui with --models-root pointing at its folder)")
            status, answer = api.call("GET", f"/api/plan?{key}={quote(str(tiny_llama))}&seq=64&batch=1")
            assert (status, answer["error"]) == (403, line)
            status, page = api.call("GET", f"/?{key}={quote(str(tiny_llama))}&model=x&seq=64&batch=1")
            assert status == 200 and f"error: {line}".encode() in page.replace(b"&#39;", b"'"), page
    finally:
        api.close()


def test_a_server_without_token_changes_nothing_and_the_cookie_works(tmp_path, tiny_llama):
    from werkzeug.serving import make_server

    from maximus.ui.app import create_app

    (tmp_path / "runs").mkdir()
    httpd = make_server("127.0.0.1", 0, create_app(tmp_path / "runs"), threaded=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", httpd.server_port, timeout=30)
        conn.request("POST", "/api/runs", body=b'{"config": "model: x"}', headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 403 and json.loads(resp.read()) == {
            "error": "this server was started without a token, so it changes nothing "
                     "(hint: start maximus ui again: it prints a URL with a token)"}
    finally:
        httpd.shutdown()
        httpd.server_close()
    api = Api(tmp_path / "c")
    try:
        conn = http.client.HTTPConnection("127.0.0.1", api.port, timeout=30)
        conn.request("GET", f"/runs?token={TOKEN}")
        cookie = conn.getresponse().getheader("Set-Cookie")
        assert "SameSite=Strict" in cookie and "HttpOnly" in cookie
        status, answer = api.call("POST", "/api/check", {"config": "model: x\ndataset: y\n"},
                                  {"Cookie": cookie.split(";")[0], "Origin": api.url})
        assert status == 400, answer  # past the token and origin checks: the planner's own one line
        assert answer == {"error": "cannot find the config of 'x' offline (hint: pass a local model directory or "
                          "config.json, or a known id such as meta-llama/Llama-3.1-8B, mistralai/Mistral-7B-v0.1, "
                          "Qwen/Qwen2.5-7B (all: KNOWN_SHAPES))"}
    finally:
        api.close()


@pytest.fixture(scope="module")
def served_run(tiny_llama, tmp_path_factory):
    """A server over a real finished tiny run (trained in this process: 3 steps), shared by the
    chat and export tests."""
    import shutil

    from maximus import Config, Trainer

    api = Api(tmp_path_factory.mktemp("served"))
    model = Path(shutil.copytree(tiny_llama, api.models / "llama"))
    cfg = _cfg(api, model, "fin", training={"max_steps": 3}, lora={"r": 4, "alpha": 64})
    Trainer(Config.from_dict(cfg)).train()
    yield api, api.runs / "fin", model
    api.close()


@pytest.fixture
def finished(served_run):
    return served_run[1:]


@pytest.fixture
def served(served_run):
    return served_run[0]


def test_chat_streams_and_its_greedy_columns_equal_maximus_generate(served, finished, capsys):
    api = served
    from maximus.cli import main

    run, model = finished
    prompt = "Reverse: red gold stone\nAnswer:"
    expected = {}
    for which, source in (("tuned", run), ("base", model)):
        assert main(["generate", str(source), "-p", prompt, "--max-new-tokens", "12"]) == 0
        expected[which] = capsys.readouterr().out.removeprefix(prompt).removesuffix("\n")
    assert expected["tuned"] != expected["base"]  # the adapter changed the answer, so the columns are told apart
    for which in ("tuned", "base"):
        status, rows = api.post("/api/chat", {"run": "fin", "model": which, "max_new_tokens": 12,
                                              "messages": [{"role": "user", "content": prompt}]})
        assert status == 200, rows
        done = rows[-1]
        assert done["done"] and done["text"] == expected[which] and done["label"] == which
        assert len(rows) > 2 and "".join(r["token"] for r in rows[:-1]) == done["text"]  # streamed piece by piece
    status, rows = api.post("/api/chat", {"run": "fin", "temperature": 0.8, "top_p": 0.9, "max_new_tokens": 5,
                                          "messages": [{"role": "user", "content": prompt}]})
    assert status == 200 and rows[-1]["done"] and rows[-1]["tokens"] <= 5
    # Capped, and one generation at a time per model.
    status, answer = api.post("/api/chat", {"run": "fin", "max_new_tokens": 100000,
                                            "messages": [{"role": "user", "content": prompt}]})
    assert (status, answer["error"]) == (400, "max_new_tokens must be a whole number from 1 to 512, got 100000 "
                                              "(hint: this server caps generations so that a tab cannot exhaust the machine)")
    from maximus.export import run_config

    loaded = api.app.extensions["maximus_chats"].get(run, run_config(run), "tuned")
    with loaded.lock:
        status, answer = api.post("/api/chat", {"run": "fin", "messages": [{"role": "user", "content": prompt}]})
    assert (status, answer["error"]) == (429, "the tuned model of this run is answering another request "
                                              "(hint: wait for it to finish; one generation at a time per model)")
    assert api.post("/api/chat", {"run": "fin", "model": "base",
                                  "messages": [{"role": "user", "content": prompt}]})[0] == 200


def _run_like(run: Path, name: str, summary: dict | None = None, **config) -> Path:
    """A copy of the finished run `run` whose run.json says `summary` and records `config`."""
    copy = Path(shutil.copytree(run, run.parent / name, ignore=shutil.ignore_patterns("exports")))
    recorded = json.loads((run / "run.json").read_text())
    recorded = {**recorded, **(summary or {}), "config": {**recorded["config"], **config}}
    (copy / "run.json").write_text(json.dumps(recorded))
    return copy


def test_chat_and_export_apply_the_servers_allow_code_not_the_runs(served, finished):
    """A run that records trust_remote_code (or allow_pickle) loads its model only on a server
    started with --allow-code: chat and export are refused before anything loads or starts."""
    api = served
    run, _ = finished
    chats = api.app.extensions["maximus_chats"]
    for name, key, what in (("coded", "trust_remote_code", "its model's code from the hub"),
                            ("pickled", "allow_pickle", "unpickling its .bin / .pt weights")):
        _run_like(run, name, **{key: True})
        before = chats.loaded()
        line = (f"run {name} records {key}: true, and loading it runs code ({what}), which this server does not run "
                "(hint: start maximus ui with --allow-code if you trust that code, or use maximus generate / "
                "maximus export)")
        assert api.post("/api/chat", {"run": name, "messages": [{"role": "user", "content": "hi"}]}) == (403, {"error": line})
        assert api.post(f"/api/runs/{name}/export", {"format": "adapter"}) == (403, {"error": line})
        assert chats.loaded() == before and not (api.runs / name / "exports").exists()
        assert not any(n == name for _, n in api.jobs._procs)


def test_chat_loads_the_runs_device_and_dtype_one_pair_at_a_time_and_refuses_what_cannot_fit(served, finished):
    """A QLoRA run in bf16 chats with NF4 weights and bf16 compute, as it trained; only one run's
    pair stays loaded; a model whose estimated weights pass the free memory is refused in one line."""
    import bitsandbytes as bnb

    from maximus.config import format_bytes
    from maximus.export import run_config
    from maximus.ui.chat import Placement, weight_bytes

    api = served
    run, model = finished
    chats = api.app.extensions["maximus_chats"]
    q4 = _run_like(run, "q4", {"method": "qlora", "dtype": "bfloat16", "device": "cpu"}, method="qlora")
    ask = lambda name, which: api.post("/api/chat", {"run": name, "model": which, "max_new_tokens": 4,  # noqa: E731
                                                     "messages": [{"role": "user", "content": "Reverse: a b\nAnswer:"}]})
    for which in ("tuned", "base"):
        status, rows = ask("q4", which)
        assert status == 200 and rows[-1]["done"], rows
    assert chats.loaded() == (q4, ["base", "tuned"])
    for which in ("tuned", "base"):
        loaded = chats.get(q4, run_config(q4), which)
        linears = [m for m in loaded.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
        assert len(linears) == 7 * 2 and {m.compute_dtype for m in linears} == {torch.bfloat16}
    placement = Placement.of_run(q4)
    assert placement == Placement(torch.device("cpu"), torch.bfloat16, True)
    assert weight_bytes(run_config(q4), placement) < weight_bytes(run_config(run), Placement.of_run(run))
    assert ask("fin", "tuned")[0] == 200
    assert chats.loaded() == (run, ["tuned"])  # the q4 pair was dropped first
    # A model far larger than this machine: refused by the estimate, before any weight is read.
    huge_dir = api.models / "huge"
    huge_dir.mkdir()
    config = json.loads((model / "config.json").read_text())
    (huge_dir / "config.json").write_text(json.dumps({**config, "hidden_size": 16384, "intermediate_size": 65536,
                                                      "num_hidden_layers": 400, "num_attention_heads": 128,
                                                      "num_key_value_heads": 8, "head_dim": 128}))
    huge = _run_like(run, "huge", model=str(huge_dir))
    need = weight_bytes(run_config(huge), Placement.of_run(huge))
    assert need > 2**40
    status, answer = ask("huge", "tuned")
    assert status == 409 and answer["error"].startswith(f"the tuned model of run huge needs about {format_bytes(need)} "
                                                        "for its weights, and this machine's RAM has "), answer
    assert answer["error"].endswith(" free (hint: stop a run or a program that holds memory, or chat with maximus "
                                    "generate on a larger machine)")
    assert chats.loaded() == (huge, [])


def test_export_from_the_api_obeys_the_export_rules_and_downloads(served, finished):
    api = served
    run, _ = finished
    foreign = run / "exports" / "adapter"
    foreign.mkdir(parents=True)
    (foreign / "notes.txt").write_text("mine")
    assert api.post("/api/runs/fin/export", {"format": "gguf", "quant": "q9_9"})[0] == 400
    status, answer = api.post("/api/runs/fin/export", {"format": "gguf", "quant": "q8_0"})
    assert (status, answer) == (202, {"run": "fin", "export": "gguf-q8_0", "path": str(run / "exports" / "gguf-q8_0.gguf"),
                                      "warnings": []})
    assert api.post("/api/runs/fin/export", {"format": "adapter"})[0] == 202
    assert api.jobs.wait("export-gguf-q8_0", "fin", timeout=180) == 0
    assert api.jobs.wait("export-adapter", "fin", timeout=180) == 2
    rows = {r["id"]: r for r in api.call("GET", "/api/runs/fin")[1]["exports"]}
    assert rows["adapter"]["status"] == "failed" and rows["adapter"]["download"] is None
    assert rows["adapter"]["last_line"].startswith(f"error: --out {foreign} already exists and holds files no Maximus "
                                                   "export wrote (e.g. 'notes.txt')")
    assert (foreign / "notes.txt").read_text() == "mine"  # never replaced
    assert rows["gguf-q8_0"]["status"] == "done" and rows["gguf-q8_0"]["download"] == "/runs/fin/exports/gguf-q8_0"
    assert rows["gguf-q8_0"]["progress"] == {"stage": "done", "done": None, "total": None, "text": "done"}
    assert rows["adapter"]["progress"] is None  # refused before its first stage
    status, data = api.call("GET", rows["gguf-q8_0"]["download"])
    gguf = run / "exports" / "gguf-q8_0.gguf"
    assert status == 200 and data == gguf.read_bytes()
    assert api.call("GET", "/runs/fin/exports/gguf-..%2f..%2fx")[0] == 404
    try:
        import llama_cpp
    except ImportError:
        pytest.skip("llama-cpp-python is not installed: the exported GGUF was checked by the export rules only")
    llm = llama_cpp.Llama(str(gguf), n_ctx=128, n_threads=1, verbose=False)
    assert llm.n_vocab() == json.loads((api.models / "llama" / "config.json").read_text())["vocab_size"]


def test_export_defaults_to_the_runs_qat_target_and_warns_on_another_quant_as_the_cli_does(served, finished):
    """A run trained for q4_0 (training.qat): the page's default quantization names it, an export
    without a quant writes q4_0, another quant is written with the CLI's own warning
    (tests/qat/test_qat_training.py), and a target GGUF cannot hold (int4) is refused in the CLI's line."""
    from maximus.evaluate.deployed import gguf_quant

    api = served
    run, _ = finished
    recorded = json.loads((run / "run.json").read_text())["config"]
    qat = _run_like(run, "qatrun", training={**recorded["training"], "qat": "q4_0"})
    status, page = api.call("GET", "/runs/qatrun")
    assert status == 200 and '<option value="">default: q4_0 (trained for it, training.qat)</option>' in page.decode()
    assert '<option value="">default</option>' in api.call("GET", "/runs/fin")[1].decode()
    status, answer = api.post("/api/runs/qatrun/export", {"format": "gguf"})
    assert (status, answer) == (202, {"run": "qatrun", "export": "gguf-q4_0", "path": str(qat / "exports" / "gguf-q4_0.gguf"),
                                      "warnings": []})
    status, answer = api.post("/api/runs/qatrun/export", {"format": "gguf", "quant": "q8_0"})
    warning = (f"warning: {qat} was trained for q4_0 (training.qat); --quant q8_0 rounds its weights differently than "
               "it trained for (omit --quant to write q4_0)")
    assert (status, answer["export"], answer["warnings"]) == (202, "gguf-q8_0", [warning])
    assert api.jobs.wait("export-gguf-q4_0", "qatrun", timeout=180) == 0
    assert api.jobs.wait("export-gguf-q8_0", "qatrun", timeout=180) == 0
    assert gguf_quant(qat / "exports" / "gguf-q4_0.gguf") == "q4_0"
    assert gguf_quant(qat / "exports" / "gguf-q8_0.gguf") == "q8_0"
    _run_like(run, "int4run", training={**recorded["training"], "qat": "int4"})
    status, answer = api.post("/api/runs/int4run/export", {"format": "ollama"})
    assert (status, answer) == (400, {"error": f"{api.runs / 'int4run'} was trained for int4 (training.qat), which --format "
                                               "ollama cannot hold (GGUF has no int4 type) (hint: pass --quant (e.g. "
                                               "--quant q8_0) to write it anyway, or --format merged)"})
    assert not (api.runs / "int4run" / "exports").exists()


def test_export_form_writes_the_adapter_beside_the_base_as_gguf_lora(served, finished):
    """`gguf-lora` from the API: the run's QAT target by default, the CLI's warnings, an id that
    names format and quantization (`gguflora-q4_0`), its row in the run's export table and a zip of
    the pair; a quant on a format without one is refused in one line."""
    import io
    import zipfile

    api = served
    run, _ = finished
    recorded = json.loads((run / "run.json").read_text())["config"]
    apart = _run_like(run, "apartrun", training={**recorded["training"], "qat": "q4_0", "qat_adapter": "separate"})
    status, page = api.call("GET", "/runs/apartrun")
    assert status == 200 and '<option value="gguf-lora">gguf-lora</option>' in page.decode()
    assert "quantization (gguf, gguf-lora, ollama)" in page.decode()
    status, answer = api.post("/api/runs/apartrun/export", {"format": "gguf-lora"})
    assert (status, answer) == (202, {"run": "apartrun", "export": "gguflora-q4_0",
                                      "path": str(apart / "exports" / "gguflora-q4_0"), "warnings": []})
    status, answer = api.post("/api/runs/apartrun/export", {"format": "gguf", "quant": "q4_0"})
    assert (status, answer["export"], answer["warnings"]) == (202, "gguf-q4_0", [
        f"warning: {apart} trained its adapter beside the rounded base (training.qat_adapter: separate); --format gguf "
        "merges it and rounds the sum, unlike training (use --format gguf-lora)"])
    assert api.jobs.wait("export-gguflora-q4_0", "apartrun", timeout=180) == 0
    assert api.jobs.wait("export-gguf-q4_0", "apartrun", timeout=180) == 0
    rows = api.call("GET", "/api/runs/apartrun")[1]["exports"]
    assert [(r["id"], r["format"], r["quant"], r["status"]) for r in rows] == [
        ("gguf-q4_0", "gguf", "q4_0", "done"), ("gguflora-q4_0", "gguf-lora", "q4_0", "done")]
    status, data = api.call("GET", rows[1]["download"])
    assert status == 200 and sorted(zipfile.ZipFile(io.BytesIO(data)).namelist()) == [
        ".maximus-export.json", "adapter.gguf", "model.gguf"]
    assert api.post("/api/runs/apartrun/export", {"format": "adapter", "quant": "q8_0"}) == (
        400, {"error": "quant applies to format gguf, gguf-lora or ollama, not adapter (hint: drop quant or change format)"})


def test_export_form_adds_the_correction_of_the_bases_rounding_to_a_gguf_lora_export(served, finished):
    """`correction_rank` (gguf-lora, `--correction-rank`): the id names it (`gguflora-q4_0-corr4`),
    the adapter file holds rank r + N, the run's export table shows it; refused in one line for
    another format, a rank that is not a whole number of 1 or more, and a quant whose rounding
    Maximus does not model (the f16 default of a run trained without QAT), before anything starts."""
    import gguf

    api = served
    run, _ = finished
    recorded = json.loads((run / "run.json").read_text())["config"]
    plain = _run_like(run, "corrrun", training={**recorded["training"]})
    status, page = api.call("GET", "/runs/corrrun")
    assert status == 200 and 'id="export-correction"' in page.decode()
    status, answer = api.post("/api/runs/corrrun/export", {"format": "gguf-lora", "quant": "q4_0", "correction_rank": 4})
    out = plain / "exports" / "gguflora-q4_0-corr4"
    assert (status, answer) == (202, {"run": "corrrun", "export": "gguflora-q4_0-corr4", "path": str(out), "warnings": []})
    assert api.jobs.wait("export-gguflora-q4_0-corr4", "corrrun", timeout=180) == 0
    rows = api.call("GET", "/api/runs/corrrun")[1]["exports"]
    assert [(r["id"], r["format"], r["quant"], r["correction_rank"], r["status"]) for r in rows] == [
        ("gguflora-q4_0-corr4", "gguf-lora", "q4_0", 4, "done")]
    ranks = {t.shape[-1] for t in gguf.GGUFReader(str(out / "adapter.gguf")).tensors if t.name.endswith(".lora_a")}
    assert ranks == {recorded["lora"]["r"] + 4}
    assert api.call("GET", rows[0]["download"])[0] == 200
    for body, error in [
        ({"format": "gguf", "correction_rank": 4},
         "correction_rank applies to format gguf-lora (the adapter file beside the base), not gguf (hint: drop "
         "correction_rank or use format gguf-lora)"),
        ({"format": "gguf-lora", "quant": "q4_0", "correction_rank": "4"},
         "correction_rank must be a whole number of 1 or more, got '4' (hint: e.g. \"correction_rank\": 64)"),
        ({"format": "gguf-lora", "quant": "q4_0", "correction_rank": 0},
         "correction_rank must be a whole number of 1 or more, got 0 (hint: e.g. \"correction_rank\": 64)"),
        ({"format": "gguf-lora", "correction_rank": 4},
         "--correction-rank 4 corrects the base's rounding, and Maximus models the rounding of q8_0, q4_0, q4_k_m, "
         "not --quant f16 (hint: pass --quant q4_k_m, q4_0 or q8_0, or drop --correction-rank)")]:
        assert api.post("/api/runs/corrrun/export", body) == (400, {"error": error}), body
    assert api.call("GET", "/runs/corrrun/exports/gguflora-q4_0-corr0")[0] == 404
    assert api.call("GET", "/runs/corrrun/exports/gguf-q4_0-corr4")[0] == 404


def test_export_progress_names_each_stage_and_counts_every_tensor(finished, tmp_path, monkeypatch):
    """What `maximus export --progress` (and the run page's export table) reports, heard in process:
    the stages in order, and the tensor count up to the number of tensors the GGUF file holds."""
    import gguf

    from maximus.export import export_gguf
    from maximus.export import progress as progress_module
    from maximus.export.progress import ExportProgress, progress_text

    run, _ = finished
    heard = []
    out, _ = export_gguf(run, tmp_path / "m.gguf", quant="q8_0", progress=lambda *a: heard.append(a))
    n = len(gguf.GGUFReader(str(out)).tensors)
    assert n > 10 and heard == ([("loading",), ("merging",)] + [("tensors", i, n) for i in range(n + 1)]
                                + [("writing",), ("checking",), ("done",)])
    assert progress_text("tensors", 12, n) == f"writing tensors 12/{n}"
    monkeypatch.setattr(progress_module, "MIN_INTERVAL_SECONDS", 3600)
    written = ExportProgress(tmp_path / "p.json")
    written("tensors", 0, n)
    written("tensors", 1, n)  # sooner than MIN_INTERVAL_SECONDS after the last write: skipped; the last count never is
    assert json.loads((tmp_path / "p.json").read_text())["done"] == 0
    written("tensors", n, n)
    assert json.loads((tmp_path / "p.json").read_text()) == {"stage": "tensors", "done": n, "total": n,
                                                               "text": f"writing tensors {n}/{n}"}


def test_cli_mistakes_are_one_line(tmp_path, monkeypatch, capsys):
    from maximus.cli import main

    assert main(["ui", "--bogus"]) == 2
    assert capsys.readouterr().err.strip() == ("error: maximus ui: unrecognized arguments: --bogus "
                                               "(hint: `maximus ui --help` lists the arguments)")
    assert main(["ui", "--runs", str(tmp_path), "--data-root", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == (f"error: --data-root {tmp_path / 'nope'} is not a directory "
                                               "(hint: point --data-root at an existing folder)")
    monkeypatch.setitem(sys.modules, "flask", None)  # Flask not installed: `import flask` raises ImportError
    assert main(["ui", "--runs", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == ("error: maximus ui needs Flask, which is not installed "
                                               "(hint: pip install 'maximusllm[ui]')")


def test_a_bug_is_one_line_of_json(served, monkeypatch):
    from maximus.ui.routes import runs as runs_routes

    def broken(*a, **k):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(runs_routes, "run_detail", broken)
    status, answer = served.call("GET", "/api/runs/fin")
    assert (status, answer) == (500, {"error": "the server failed on this request (RuntimeError) "
                                               "(hint: see the server log)"})
    status, page = served.call("GET", "/runs/fin")
    assert status == 500 and page == b"error: the server failed on this request (RuntimeError) (hint: see the server log)\n"


def test_the_run_form_has_every_key_of_config_md_with_its_default_and_meaning():
    import ast

    import re

    from maximus.ui.form import config_sections

    rows = {}
    for line in (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text().splitlines():
        m = re.match(r"^\| `([^`]+)` \| `(.*?)` \| `(.*?)` \| (.*) \|$", line)
        if m:
            rows[m.group(1)] = (m.group(3), m.group(4))
    fields = [f for _, _, fs in config_sections() for f in fs]
    assert len(fields) > 80
    for f in fields:
        assert f.key in rows, f.key
        default, meaning = rows[f.key]
        assert f.doc == meaning, f.key
        if default == "required":
            assert f.required and f.default == "", f.key
        else:
            value = ast.literal_eval(default)  # config.md writes repr(default)
            assert f.default == ("" if value is None else str(value).lower() if isinstance(value, bool) else
                                 "[" + ", ".join(map(str, value)) + "]" if isinstance(value, (list, tuple)) else str(value)), f.key
    assert {f.key for f in fields} == {k for k, (default, _) in rows.items() if default != "(section)"}
