"""`maximus ui` in a real headless Chromium (Debian's chromium + chromium-driver, driven by Selenium)
and over real HTTP: the planner page equals `maximus plan --json`, a run's charts gain points
while a real `maximus-train` writes to it, the token and path-confinement rules hold.

Set MAXIMUS_UI_SCREENSHOTS=DIR to save the three pages' screenshots there (docs/ui/ is made so).
"""
from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from tiny import tiny_config

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
needs_browser = pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER) and os.environ.get("CI") != "true",
    reason="Debian chromium + chromium-driver not installed (apt-get install chromium chromium-driver); "
           "under CI=true a missing browser fails instead")
SCREENSHOTS = os.environ.get("MAXIMUS_UI_SCREENSHOTS")
PLAN_ARGS = ["--model", "meta-llama/Llama-3.1-8B", "--method", "qlora", "--seq", "2048", "--batch", "2",
             "--lora-r", "16", "--optimizer", "adamw", "--dtype", "bf16", "--budget", "16GB"]


def _cli_started(*args: str) -> subprocess.Popen:
    """`maximus ARGS` in a child process, read later by `_cli_done`: a test starts the CLI's plans
    first and meanwhile has the page plan the same (on two cores, at the same time)."""
    return subprocess.Popen([sys.executable, "-m", "maximus.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _cli_done(proc: subprocess.Popen, check: bool = True) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    if check and proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, proc.args, out, err)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _cli_done(_cli_started(*args), check)


@pytest.fixture
def start_cli():
    """`_cli_started` for a test; a child still running at its end (a failed assertion) is killed."""
    children: list[subprocess.Popen] = []

    def start(*args: str) -> subprocess.Popen:
        children.append(_cli_started(*args))
        return children[-1]

    yield start
    for child in children:
        if child.poll() is None:
            child.kill()
            child.communicate()


class Server:
    """The real app on a free loopback port, served by Werkzeug in a thread."""

    def __init__(self, runs: Path, token: str | None = None):
        from werkzeug.serving import make_server

        from maximus.ui.app import create_app

        self.httpd = make_server("127.0.0.1", 0, create_app(runs, token=token), threaded=True)
        self.port = self.httpd.server_port
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def get(self, raw_path: str, headers: dict | None = None) -> tuple[int, bytes]:
        """A request with the path sent exactly as written (no client-side normalisation of '..')."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request("GET", raw_path, headers=headers or {})
        resp = conn.getresponse()
        body = resp.read()
        conn.close()
        return resp.status, body

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def runs_dir(tmp_path) -> Path:
    (tmp_path / "runs").mkdir()
    return tmp_path / "runs"


@pytest.fixture
def server(runs_dir):
    s = Server(runs_dir)
    yield s
    s.close()


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.fail("CI=true and Debian chromium / chromium-driver are missing: .ci/run must install them")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
                 "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1300,1000"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(120)
    yield driver
    driver.quit()


def _shot(driver, name: str) -> None:
    if SCREENSHOTS:
        Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(SCREENSHOTS) / name))


def _fill_planner(driver, url: str, *, budget: str, model: str | None = None, upload: Path | None = None) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    driver.get(url + "/")
    if model:
        Select(driver.find_element(By.ID, "model")).select_by_value(model)
    if upload:
        driver.find_element(By.ID, "config_file").send_keys(str(upload))
    Select(driver.find_element(By.ID, "method")).select_by_value("qlora")
    for field, value in (("seq", "2048"), ("batch", "2"), ("lora_r", "16"), ("budget", budget)):
        box = driver.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    Select(driver.find_element(By.ID, "optimizer")).select_by_value("adamw")
    Select(driver.find_element(By.ID, "dtype")).select_by_value("bf16")
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    button = driver.find_element(By.ID, "plan-button")
    button.click()
    wait = WebDriverWait(driver, 120)
    wait.until(ec.staleness_of(button))  # the answer is a new page
    wait.until(lambda d: d.find_elements(By.ID, "result") or d.find_elements(By.ID, "error"))


def _page_cards(driver) -> list[dict]:
    from selenium.webdriver.common.by import By

    rows = []
    for tr in driver.find_elements(By.CSS_SELECTOR, "#cards tbody tr"):
        rows.append({"card": tr.get_attribute("data-card"), "fits": tr.get_attribute("data-fits") == "yes",
                     "peak": tr.get_attribute("data-peak"), "usd": tr.get_attribute("data-usd"),
                     "max_seq": tr.get_attribute("data-max-seq"),
                     "cells": [td.text for td in tr.find_elements(By.TAG_NAME, "td")]})
    return rows


def _assert_page_equals_cli(driver, cli: dict) -> None:
    from selenium.webdriver.common.by import By

    from maximus.config import format_bytes

    rows = _page_cards(driver)
    assert [r["card"] for r in rows] == [c["card"] for c in cli["cards"]]
    for row, card in zip(rows, cli["cards"]):
        assert row["fits"] == card["fits"], card["card"]
        assert row["peak"] == (str(card["plan"]["peak_bytes"]) if card["plan"] else ""), card["card"]
        assert row["usd"] == (repr(card["usd_per_million_tokens"]) if card["usd_per_million_tokens"] is not None
                              else ""), card["card"]
        assert row["max_seq"] == (str(card["longest_context_tokens"]) if card.get("longest_context_tokens") is not None else "")
        assert row["cells"][1] == format_bytes(card["memory_bytes"])
        assert row["cells"][4] == (format_bytes(card["plan"]["peak_bytes"]) if card["plan"] else "-")
    assert driver.find_element(By.ID, "requested-peak").get_attribute("data-bytes") == str(cli["peak_bytes"])
    cheapest = driver.find_element(By.ID, "cheapest").text
    assert cheapest == (f"cheapest card that fits: {cli['cheapest_card']}" if cli["cheapest_card"] else
                        "no listed card fits: use more GPUs, method qlora, or a shorter sequence")


@needs_browser
def test_planner_page_equals_maximus_plan_json_and_bad_input_is_its_one_line(browser, server, tmp_path, start_cli):
    """Each answer of the page is what `maximus plan` says: a bad value is the planner's own one line
    (after which the planner still plans), a plan equals `--json`'s, of a hub model and of an
    uploaded config.json. The CLI runs start first, so that the page plans while they do (a plan of
    an 8B model on every card takes seconds of one core)."""
    from selenium.webdriver.common.by import By

    from maximus.config import Config

    # An uploaded config.json is planned exactly like `maximus plan --model that/config.json`.
    shape = {"model_type": "mistral", "vocab_size": 32768, "hidden_size": 4096, "intermediate_size": 14336,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "max_position_embeddings": 32768, "tie_word_embeddings": False}
    upload = tmp_path / "config.json"
    upload.write_text(json.dumps(shape))
    started = {"16GB": start_cli("plan", *PLAN_ARGS, "--json"),
               "upload": start_cli("plan", "--model", str(upload), *PLAN_ARGS[2:-2], "--budget", "T4", "--json"),
               "lots": start_cli("plan", *PLAN_ARGS[:-1], "lots"),
               "no-such": start_cli("plan", "--model", "no-such/model", "--seq", "2048", "--batch", "2")}

    cli = _cli_done(started["lots"], check=False)
    assert cli.returncode == 2
    expected = cli.stderr.strip()
    assert expected.startswith("error: ") and "\n" not in expected
    _fill_planner(browser, server.url, model="meta-llama/Llama-3.1-8B", budget="lots")
    assert browser.find_element(By.ID, "error").text == expected
    assert "Traceback" not in browser.page_source

    _fill_planner(browser, server.url, model="meta-llama/Llama-3.1-8B", budget="16GB")
    browser.find_element(By.ID, "seq")  # still on the planner
    cli = json.loads(_cli_done(started["16GB"]).stdout)
    _assert_page_equals_cli(browser, cli)
    assert cli["budget"]["fits"]
    assert all(isinstance(c["longest_context_tokens"], int) for c in cli["cards"] if c["fits"])
    assert browser.find_element(By.ID, "budget-plan").text.startswith("fits: qlora mb ")
    # The YAML on the page is a valid maximus-train config for that plan.
    text = browser.find_element(By.ID, "yaml").text
    cfg = Config.from_dict(yaml.safe_load(text))
    assert (cfg.method, cfg.training.seq_len, cfg.training.batch_size, cfg.lora.r) == ("qlora", 2048, 2, 16)
    assert cfg.training.micro_batch_size == cli["budget"]["plan"]["micro_batch_size"]
    _shot(browser, "planner.png")

    _fill_planner(browser, server.url, upload=upload, budget="T4")
    _assert_page_equals_cli(browser, json.loads(_cli_done(started["upload"]).stdout))
    assert browser.find_element(By.TAG_NAME, "h2").text == "uploaded config.json"

    # Bad values sent without the form (after the plans: nothing else runs while the server answers).
    status, body = server.get("/?model=no-such/model&seq=2048&batch=2")
    cli = _cli_done(started["no-such"], check=False)
    assert cli.returncode == 2
    assert status == 200 and cli.stderr.strip().encode() in body.replace(b"&#39;", b"'")
    status, body = server.get("/?model=meta-llama/Llama-3.1-8B&seq=two")
    assert b"error: sequence length must be a positive whole number, got &#39;two&#39; (hint: e.g. seq=2048)" in body


def test_upload_is_capped_and_parsed_as_json_only(server):
    import urllib.error
    import urllib.request

    def post(content: bytes) -> tuple[int, str]:
        boundary = "maximusboundary"
        body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"config_file\"; filename=\"config.json\"\r\n"
                f"Content-Type: application/json\r\n\r\n").encode() + content + f"\r\n--{boundary}--\r\n".encode()
        req = urllib.request.Request(server.url + "/", data=body, method="POST",
                                     headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    status, page = post(b" " * (300 * 1024))
    assert status == 413
    assert "error: config.json is larger than 256 KiB (hint: upload only the model&#39;s config.json)" in page
    status, page = post(b"!!python/object/apply:os.system ['echo pwned']")
    assert status == 200 and "is not valid JSON" in page and "pwned" not in page.replace("echo pwned", "")
    status, page = post(b"[1, 2]")
    assert "error: uploaded &#39;config.json&#39; is not a JSON object (hint: upload a model&#39;s config.json)" in page


def _make_run(root: Path, name: str, *, finished: bool = False, checkpoint: bool = False) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.5, "lr": 1e-3, "tokens_per_s": 10.0,
                                                 "memory_bytes": 100, "peak_memory_bytes": 200}) + "\n")
    if checkpoint:
        (d / "checkpoints" / "step-1").mkdir(parents=True)
    if finished:
        (d / "run.json").write_text(json.dumps({"config": {"model": "m", "method": "lora"}, "method": "lora",
                                                "steps": 1, "plan": {"peak_bytes": 300, "budget_bytes": 400},
                                                "memory": {"peak_bytes": 250, "budget_bytes": 400},
                                                "eval": {"before": {"loss": 3.0}, "after": {"loss": 2.0}}}))
    return d


def test_run_statuses_from_the_files_a_trainer_leaves(runs_dir):
    from maximus.train.lock import RunLock
    from maximus.ui.runs import list_runs

    _make_run(runs_dir, "done", finished=True)
    _make_run(runs_dir, "stopped", checkpoint=True)
    _make_run(runs_dir, "crashed")
    live = _make_run(runs_dir, "group/live")
    with RunLock(live):  # the trainer's own lock, held as a running trainer holds it
        statuses = {r.name: r.status for r in list_runs(runs_dir)}
        assert statuses == {"done": "finished", "stopped": "interrupted", "crashed": "failed", "group/live": "running"}
    assert {r.name: r.status for r in list_runs(runs_dir)}["group/live"] == "failed"
    done = next(r for r in list_runs(runs_dir) if r.name == "done")
    assert (done.best_eval_loss, done.peak_bytes, done.budget_bytes, done.predicted_peak_bytes) == (2.0, 250, 400, 300)


def test_paths_are_confined_to_runs(server, runs_dir, tmp_path):
    outside = _make_run(tmp_path, "secret-run", finished=True)
    _make_run(runs_dir, "ok", finished=True)
    (runs_dir / "link-out").symlink_to(outside, target_is_directory=True)
    (runs_dir / "ok" / "loss.png").symlink_to(tmp_path / "secret-run" / "run.json")
    assert server.get("/runs/ok")[0] == 200
    assert server.get("/api/runs/ok/metrics?since=0")[0] == 200
    for path in ("/runs/../secret-run", "/runs/%2e%2e/secret-run", "/api/runs/..%2Fsecret-run",
                 "/api/runs/%2e%2e%2fsecret-run/metrics", "/runs/link-out", "/api/runs/link-out/metrics",
                 "/runs//etc", "/runs/ok/loss.png", "/runs/ok/checkpoints", "/runs/nothing-here",
                 "/runs/..", "/api/runs/ok/../../secret-run"):
        status, body = server.get(path)
        assert status == 404, (path, status)
        assert b"secret" not in body.replace(b"secret-run", b"")
    names = {r["name"] for r in json.loads(server.get("/api/runs")[1])}
    assert names == {"ok"}  # the symlinked run outside is not listed either


def test_token_is_checked_on_every_request(runs_dir):
    s = Server(runs_dir, token="s3cret-token")
    try:
        for path in ("/", "/runs", "/api/runs", "/static/chart.umd.min.js", "/api/plan?model=x"):
            assert s.get(path)[0] == 403, path
            assert s.get(path + ("&" if "?" in path else "?") + "token=wrong")[0] == 403, path
        assert s.get("/api/runs", {"Authorization": "Bearer s3cret-token"})[0] == 200
        status, _ = s.get("/runs?token=s3cret-token")
        assert status == 200
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
        conn.request("GET", "/runs?token=s3cret-token")
        cookie = conn.getresponse().getheader("Set-Cookie")
        conn.close()
        assert cookie.startswith("maximus_ui_token=s3cret-token") and "HttpOnly" in cookie
        assert s.get("/api/runs", {"Cookie": "maximus_ui_token=s3cret-token"})[0] == 200
    finally:
        s.close()


def test_cli_off_loopback_makes_and_prints_a_token(runs_dir):
    from maximus.ui.command import is_loopback

    assert [is_loopback(h) for h in ("127.0.0.1", "localhost", "::1", "127.0.0.2", "0.0.0.0", "192.168.1.5")] == \
        [True, True, True, True, False, False]
    proc = subprocess.Popen([sys.executable, "-m", "maximus.cli", "ui", "--runs", str(runs_dir), "--host", "0.0.0.0",
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = proc.stdout.readline()
        assert first.startswith("--host 0.0.0.0 is not loopback: every request needs this token (made for this run): ")
        token = first.rsplit(" ", 1)[1].strip()
        second = proc.stdout.readline()
        port = int(second.split("http://0.0.0.0:", 1)[1].split("/", 1)[0])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/api/runs")
        assert conn.getresponse().status == 403
        conn.close()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", f"/api/runs?token={token}")
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    bad = _cli("ui", "--runs", str(runs_dir / "metrics.jsonl"), "--port", "99999", check=False)
    assert bad.returncode == 2
    assert bad.stderr.strip() == "error: --port 99999 is not a port number (hint: use 1-65535, or 0 for any free port)"


@needs_browser
def test_run_page_charts_grow_while_a_real_run_trains(browser, server, runs_dir, tiny_llama, pc_data):
    from selenium.webdriver.common.by import By

    out = runs_dir / "live"
    cfg = tiny_config(tiny_llama, pc_data, out, training={"max_steps": 30, "log_every": 1, "save_every": 10},
                      eval={"every": 10, "prompts": ["Reverse: red gold\nAnswer:"]},
                      optimization={"target_vram": "1GB", "gradient_checkpointing": "off"})
    cfg_path = runs_dir.parent / "live.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "maximus.cli", "train", "--config", str(cfg_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 240
        while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text().strip():
            assert proc.poll() is None, proc.stderr.read()
            assert time.time() < deadline
            time.sleep(0.2)
        browser.get(server.url + "/runs")
        row = browser.find_element(By.CSS_SELECTOR, "#runs tr[data-run='live']")
        seen_running = row.get_attribute("data-status") == "running"
        browser.get(server.url + "/runs/live")

        def points() -> int:
            return int(browser.find_element(By.ID, "points").text)

        first = 0
        while first == 0 and time.time() < deadline:
            time.sleep(0.3)
            first = points()
        assert 0 < first
        grown = first
        while grown == first and proc.poll() is None and time.time() < deadline:
            time.sleep(0.3)
            grown = points()
        assert grown > first, "the loss chart gained no points while the run trained"
        seen_running = seen_running or browser.find_element(By.ID, "status").text == "running"
        assert seen_running
        # While it runs, the memory panel already has the budget and the predicted peak (plan.json).
        live = json.loads((out / "plan.json").read_text())
        lines = browser.execute_script("const d = Chart.getChart('memory-chart').data.datasets;"
                                       "return [d[2].data.map(p => p.y), d[3].data.map(p => p.y)];")
        assert lines[0] and set(lines[0]) == {10**9 / 2**20}  # the 1GB budget, in MiB on a tiny run
        assert lines[1] and set(lines[1]) == {live["plan"]["peak_bytes"] / 2**20}
        assert proc.wait(timeout=240) == 0, proc.stderr.read()
        while browser.find_element(By.ID, "status").text != "finished" and time.time() < deadline:
            time.sleep(0.3)
        assert browser.find_element(By.ID, "status").text == "finished"
        n_steps = sum(1 for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line)
        assert points() == n_steps == 30
        # Eval points reached the loss chart, as held-out points (dataset 1).
        evals = browser.execute_script("return Chart.getChart('loss-chart').data.datasets[1].data.length")
        assert evals == sum(1 for line in (out / "metrics.jsonl").read_text().splitlines() if "eval_loss" in line) > 0
        browser.get(server.url + "/runs/live")
        time.sleep(1.5)
        assert browser.find_element(By.ID, "before-after").text.startswith("base (before) tuned (after)")
        _shot(browser, "run.png")
        browser.get(server.url + "/runs")
        assert browser.find_element(By.CSS_SELECTOR, "#runs tr[data-run='live']").get_attribute("data-status") == "finished"
        _shot(browser, "runs.png")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _wait_until(cond, timeout=180, what="condition"):
    deadline = time.time() + timeout
    while True:
        value = cond()
        if value:
            return value
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@needs_browser
def test_train_stop_resume_chat_export_from_the_pages(browser, tiny_model_dirs, tmp_path, capsys):
    """The whole job in the browser: the run form (a field error beside its field, the plan equal to
    `maximus plan --config --json`), start, the chart grows, stop (exit 75, checkpoint), resume, the
    adapter bit-equal to an uninterrupted run's; chat (greedy tuned = `maximus generate`); GGUF export
    from the page, downloaded and loaded by llama.cpp."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select
    from test_ui_api import SLOW_TRAIN, STEPS, TOKEN, Api, _adapter, _cfg, _in_use

    from maximus import Config, Trainer
    from maximus.cli import main
    from maximus.plan_command import plan_json

    api = Api(tmp_path, train_argv=[sys.executable, "-c", SLOW_TRAIN], slots=1)
    try:
        model = Path(shutil.copytree(tiny_model_dirs["llama"], api.models / "llama"))
        cfg = _cfg(api, model, "flow", training={"max_steps": 2, "save_every": 2}, eval={"enabled": False},
                   optimization={"target_vram": "1GB", "gradient_checkpointing": "off"})
        browser.get(api.url + f"/train?token={TOKEN}")  # the printed URL: sets the SameSite=Strict cookie
        browser.find_element(By.ID, "yaml").send_keys(yaml.safe_dump(cfg))
        browser.find_element(By.CSS_SELECTOR, "details[data-section='training'] summary").click()
        steps = browser.find_element(By.ID, "f-training.max_steps")
        steps.clear()
        steps.send_keys("abc")
        browser.find_element(By.ID, "check-button").click()
        beside = browser.find_element(By.CSS_SELECTOR, "[data-error-for='training.max_steps']")
        expected = None
        try:
            Config.from_dict({**cfg}, ["training.max_steps=abc"], source="config")
        except Exception as exc:  # the CLI's own message for the same override
            expected = f"error: {exc}"
        _wait_until(lambda: beside.text, what="the field error")
        assert beside.text == expected and expected.startswith("error: config: invalid value for 'training.max_steps'")
        steps.clear()
        steps.send_keys(str(STEPS))  # sent as the override training.max_steps=6 over the YAML's 2
        browser.find_element(By.ID, "check-button").click()
        _wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, "#plan-result #cards tbody tr"), what="the plan")
        assert beside.text == ""
        run_cfg = {**cfg, "training": {**cfg["training"], "max_steps": STEPS}}
        cfg_path = tmp_path / "flow.yaml"
        cfg_path.write_text(yaml.safe_dump(run_cfg))
        cli = plan_json(["--config", str(cfg_path)])  # what `maximus plan --config flow.yaml --json` prints
        _assert_page_equals_cli(browser, cli)
        assert browser.find_element(By.ID, "budget-plan").text.startswith("fits: lora mb 2 x acc 2")
        browser.execute_script("document.getElementById('yaml').scrollIntoView()")
        _shot(browser, "train.png")
        browser.execute_script("document.getElementById('plan-result').scrollIntoView()")
        _shot(browser, "train-plan.png")
        browser.find_element(By.ID, "start-button").click()
        _wait_until(lambda: browser.current_url.endswith("/runs/flow"), what="the run page")
        run = api.runs / "flow"
        status, body = api.post("/api/runs", {"config": yaml.safe_dump(run_cfg)})  # one run per output dir
        assert (status, body["error"]) == (409, _in_use(run, f"pid {api.jobs.record('train', 'flow')['pid']}"))
        points = lambda: int(browser.find_element(By.ID, "points").text)  # noqa: E731
        first = _wait_until(points, what="the first point")
        _wait_until(lambda: points() > first, what="the chart to grow")
        browser.find_element(By.ID, "stop-button").click()
        assert api.jobs.wait("train", "flow", timeout=120) == 75
        _wait_until(lambda: browser.find_element(By.ID, "status").text == "interrupted", what="interrupted")
        _wait_until(lambda: browser.find_element(By.ID, "exit-code").text == "last exit code 75", what="exit code")
        stopped = int(browser.find_element(By.ID, "steps-done").text)
        assert stopped < STEPS and (run / "checkpoints" / f"step-{stopped:06d}").is_dir()
        assert api.post("/api/runs/flow/stop")[0] == 409  # not running
        old = api.jobs.record("train", "flow")["pid"]
        browser.find_element(By.ID, "resume-button").click()
        _wait_until(lambda: (api.jobs.record("train", "flow") or {}).get("pid") != old, what="the resumed child")
        # The queue, while the resumed run holds the one slot: a second run waits, with its position
        # on the Runs page, and is cancelled there (nothing of it is left; it never starts).
        waiting = _cfg(api, model, "waits", training={"max_steps": 1})
        assert api.post("/api/runs", {"config": yaml.safe_dump(waiting)}) == (
            201, {"run": "waits", "status": "queued", "queue_position": 1})
        browser.get(api.url + "/runs")
        queued = "#runs tr[data-run='waits'][data-status='queued'] .position"
        assert _wait_until(lambda: _texts(browser, queued), what="the queued row") == ["1"]
        _shot(browser, "runs.png")

        def cancelled() -> bool:  # clicked again if the page reloaded (a status changed) under the click
            if not browser.find_elements(By.CSS_SELECTOR, "#runs tr[data-run='waits']"):
                return True
            _click(browser, "#runs tr[data-run='waits'] button.cancel")
            time.sleep(0.5)
            return False

        _wait_until(cancelled, timeout=60, what="the cancel button to take the run out of the queue")
        assert api.jobs.queued() == [] and not (api.runs / "waits").exists()
        browser.get(api.url + "/runs/flow")
        assert api.jobs.wait("train", "flow", timeout=180) == 0
        _wait_until(lambda: browser.find_element(By.ID, "status").text == "finished", what="finished")
        assert api.post("/api/runs/flow/resume")[0] == 409  # finished
        rows = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert rows == list(range(1, STEPS + 1))
        Trainer(Config.from_dict({**run_cfg, "output_dir": str(tmp_path / "ref")})).train()
        a, b = _adapter(run), _adapter(tmp_path / "ref")
        assert a.keys() == b.keys() and all(torch_equal(a[k], b[k]) for k in a)

        # Chat: base | tuned, streamed; greedy tuned = maximus generate.
        browser.get(api.url + "/runs/flow")
        prompt = "Reverse: red gold stone\nAnswer:"
        capsys.readouterr()  # the reference run's summary
        assert main(["generate", str(run), "-p", prompt, "--max-new-tokens", "12"]) == 0
        generated = capsys.readouterr().out.removeprefix(prompt).removesuffix("\n")
        box = browser.find_element(By.ID, "chat-max")
        box.clear()
        box.send_keys("12")
        browser.execute_script("document.getElementById('chat-prompt').value = arguments[0]", prompt)
        browser.find_element(By.ID, "chat-send").click()
        answers = _wait_until(lambda: [e for e in browser.find_elements(By.CSS_SELECTOR, ".chat pre.answer")
                                       if e.get_attribute("data-done") == "yes"] if len(
            [e for e in browser.find_elements(By.CSS_SELECTOR, ".chat pre.answer") if e.get_attribute("data-done")]) == 2
            else None, what="both answers")
        tuned = browser.find_element(By.CSS_SELECTOR, "#chat-tuned pre.answer")
        assert len(answers) == 2 and tuned.get_attribute("textContent") == generated

        # Export GGUF from the page; the download link serves the file llama.cpp loads.
        Select(browser.find_element(By.ID, "export-format")).select_by_value("gguf")
        Select(browser.find_element(By.ID, "export-quant")).select_by_value("q8_0")
        browser.find_element(By.ID, "export-button").click()
        _wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, "#exports tr[data-export='gguf-q8_0']"), what="row")
        assert api.jobs.wait("export-gguf-q8_0", "flow", timeout=180) == 0
        row = _wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, "#exports tr[data-status='done']"), what="done")[0]
        assert row.get_attribute("data-stage") == "done" and row.find_element(By.CSS_SELECTOR, ".stage").text == "done"
        link = row.find_element(By.LINK_TEXT, "download").get_attribute("href")
        assert link == f"{api.url}/runs/flow/exports/gguf-q8_0"
        status, data = api.call("GET", "/runs/flow/exports/gguf-q8_0")
        gguf = run / "exports" / "gguf-q8_0.gguf"
        assert status == 200 and data == gguf.read_bytes()
        browser.execute_script("document.getElementById('chat-section').scrollIntoView()")
        _shot(browser, "chat-export.png")
        browser.execute_script("window.scrollTo(0, 0)")
        _shot(browser, "run-controls.png")
        browser.get(api.url + "/runs")
        assert browser.find_element(By.CSS_SELECTOR, "#runs tr[data-run='flow']").get_attribute("data-status") == "finished"
        try:
            import llama_cpp
        except ImportError:
            pytest.skip("llama-cpp-python is not installed: the exported GGUF was not loaded")
        llm = llama_cpp.Llama(str(gguf), n_ctx=128, n_threads=1, verbose=False)
        assert llm.n_vocab() == json.loads((model / "config.json").read_text())["vocab_size"]
    finally:
        api.close()


def _texts(browser, css: str) -> list[str]:
    """The texts of the elements `css` selects; [] while the page reloads under us."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    try:
        return [e.text for e in browser.find_elements(By.CSS_SELECTOR, css)]
    except StaleElementReferenceException:
        return []


def _click(browser, css: str) -> bool:
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.common.by import By

    try:
        browser.find_element(By.CSS_SELECTOR, css).click()
    except (NoSuchElementException, StaleElementReferenceException):
        return False
    return True


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


def test_run_page_shows_the_prompted_column_and_the_verdict(server, runs_dir):
    from maximus.evaluate.report import verdict

    d = _make_run(runs_dir, "prompted", finished=True)
    summary = json.loads((d / "run.json").read_text())
    after, prompted = {"loss": 0.28, "exact_match": 0.62}, {"loss": 0.79, "exact_match": 0.20, "few_shot": 4}
    summary["eval"] = {"before": {"loss": 3.59, "exact_match": 0.0}, "after": after, "prompted": prompted,
                       "verdict": verdict(after, prompted, ["exact_match"])}
    (d / "run.json").write_text(json.dumps(summary))
    status, body = server.get("/runs/prompted")
    page = body.decode()
    assert status == 200
    assert "<th>base + 4-shot</th>" in page
    assert "<td>exact_match</td><td>0.0000</td><td>0.2000</td><td>0.6200</td>" in page
    assert f"<b>{summary['eval']['verdict']['text']}</b>" in page
