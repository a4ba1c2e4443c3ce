"""The run form's "Check and plan" shows the data check beside the plan: the same checks and rows
as `maximus data check --json`, the template preview with the trained tokens highlighted, and
the line `data.on_problem: error` would stop the run with."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from test_ui_api import TOKEN, Api, _cfg

from maximus.cli import main


def test_check_and_plan_shows_the_data_report_beside_the_plan(tmp_path, tiny_llama, capsys):
    api = Api(tmp_path)
    try:
        model = Path(shutil.copytree(tiny_llama, api.models / "llama"))
        cfg = _cfg(api, model, "checked", eval={"enabled": False})
        data = Path(cfg["dataset"]["path"])
        rows = data.read_text().splitlines()
        data.write_text("\n".join(rows + rows[:2]) + "\n")  # lines 65 and 66 copy lines 1 and 2
        status, answer = api.post("/api/check", {"config": yaml.safe_dump(cfg)})
        assert status == 200 and answer["plan"]["peak_bytes"] > 0

        config = tmp_path / "run.yaml"
        config.write_text(yaml.safe_dump(answer["config"]))
        assert main(["data", "check", "--config", str(config), "--json"]) == 0
        cli = json.loads(capsys.readouterr().out)
        assert answer["data_check"] == cli  # every check has at most 20 rows here: nothing cut
        duplicates = next(c for c in cli["checks"] if c["name"] == "exact_duplicates")
        assert duplicates["rows"][-2:] == [{"file": str(data), "line": 65}, {"file": str(data), "line": 66}]

        html = answer["data_html"]
        assert '<tr data-check="exact_duplicates" data-count="%d" data-over="yes" class="over">' % duplicates["count"] in html
        assert "pc.jsonl:65, pc.jsonl:66" in html
        first = cli["preview"][0]["segments"]
        trained = next(s["text"] for s in first if s["trained"])
        assert f'<mark class="trained">{trained}</mark>' in html.replace("&lt;", "<").replace("&gt;", ">").replace("&#39;", "'")
        assert answer["data_check"]["stops"] is None

        status, answer = api.post("/api/check", {"config": yaml.safe_dump(cfg), "overrides": ["data.on_problem=error"]})
        assert status == 200 and answer["data_check"]["stops"].startswith("data check: exact_duplicates in ")
        assert 'id="data-stops"' in answer["data_html"]

        data.write_text("not json\n")
        status, answer = api.post("/api/check", {"config": yaml.safe_dump(cfg)})
        assert status == 200, answer
        assert answer["data_check"] == {"error": f"{data}:1: malformed JSON: Expecting value at column 1 "
                                                 "(hint: fix the line, or set `on_error: skip` on the dataset to skip "
                                                 "bad records)"}
    finally:
        api.close()
    assert TOKEN
