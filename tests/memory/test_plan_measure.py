"""`maximus plan --measure --config`: a real probe of the run at micro-batch 1 calibrates the
estimator; its calibrated prediction for the configured run (a 4x larger micro-batch) is checked
against a real run at that micro-batch."""
import io
import json
from contextlib import redirect_stdout

import pytest
import yaml

from maximus import Config, Trainer
from maximus.errors import ConfigError
from maximus.plan_command import plan_main

from tiny import build_tiny_model_dir, one_thread, tiny_config, write_prompt_completion  # noqa: F401 - fixture

pytestmark = pytest.mark.usefixtures("one_thread")


def test_measure_calibrates_on_a_probe_and_predicts_a_4x_micro_batch(tmp_path):
    model = build_tiny_model_dir(tmp_path / "model")
    data = write_prompt_completion(tmp_path / "data.jsonl", n=40)
    run = tiny_config(model, data, tmp_path / "out", training={"batch_size": 8, "micro_batch_size": 4, "packing": False,
                                                               "max_steps": 3}, eval={"enabled": False})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(run))
    out = io.StringIO()
    with redirect_stdout(out):
        assert plan_main(["--measure", "--config", str(path), "--json"]) == 0
    m = json.loads(out.getvalue())["measure"]  # stdout is the JSON alone: the probe prints nothing
    probe = m["probe"]
    assert (probe["steps"], probe["probe_micro_batch"], probe["device"]) == (3, 1, "cpu")
    assert probe["measured_peak_bytes"] > probe["measured_static_bytes"] > 0
    assert abs(probe["static_scale"] - 1) < 0.05  # weights, adapters and AdamW state are counted exactly
    here = m["here"]
    assert here["plan"]["micro_batch_size"] == 4 and here["extrapolation"] == pytest.approx(4, rel=0.3)
    assert m["cheapest_card"] == "T4" and all(c["fits"] for c in m["cards"])

    measured = Trainer(Config.from_dict(run)).train()["memory"]["peak_bytes"]
    assert abs(here["calibrated_peak_bytes"] / measured - 1) < 0.10


def test_measure_needs_a_config():
    with pytest.raises(ConfigError) as err:
        plan_main(["--measure", "--model", "meta-llama/Llama-3.1-8B"])
    assert err.value.message == "maximus plan --measure needs --config (the probe trains the run it describes)"
