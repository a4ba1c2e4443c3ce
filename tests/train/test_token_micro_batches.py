"""Token-budget micro-batches (`training.micro_batch_tokens`): a step's rows split by tokens
(longest first) give the same loss and update as row-count micro-batches; the planner picks the
budget; a budget below the longest row is a one-line error naming that row's length."""
import json

import pytest
import torch

from maximus import Config, Trainer
from maximus.errors import ConfigError
from maximus.memory import plan_run
from maximus.memory.lengths import split_by_tokens
from maximus.train.order import read_lengths, row_length

from tiny import build_tiny_model_dir, one_thread, tiny_config  # noqa: F401 - fixture

pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = "red green blue gold stone river cloud tiger eagle maple north south".split()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("token_mb")
    model = build_tiny_model_dir(root / "model")
    data = root / "mixed.jsonl"
    with open(data, "w") as f:  # answers of 1 to 24 words: a few long rows among short ones
        for i in range(24):
            n = 1 + (i * 7) % 24
            f.write(json.dumps({"prompt": "Say:", "completion": " " + " ".join(WORDS[j % 12] for j in range(n))}) + "\n")
    return tiny_config(model, data, root / "out", training={"batch_size": 8, "micro_batch_size": 2, "max_steps": 2,
                                                            "packing": False, "seq_len": 64},
                       eval={"enabled": False})


def test_split_by_tokens_fills_longest_first():
    assert split_by_tokens([3, 9, 2, 2, 8], 18) == [[1, 4], [0, 2, 3]]
    assert split_by_tokens([3, 9, 2, 2, 8], 9) == [[1], [4], [0, 2, 3]]


def _first_step(cfg: Config, out):
    """The first step's result and the accumulated gradients before the optimizer step."""
    grads = {}

    def keep(trainer, step):
        grads.update({n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad})

    trainer = Trainer(Config.from_dict({**cfg.to_dict(), "output_dir": str(out)}), hooks={"after_backward": keep})
    trainer.setup()
    return trainer, trainer.train_step(1), grads


def test_token_micro_batches_give_the_loss_and_gradients_of_row_count_ones(run, tmp_path):
    rows_cfg = Config.from_dict(run)
    longest = read_lengths(rows_cfg).longest
    tokens_cfg = Config.from_dict(dict(run, training={**run["training"], "micro_batch_tokens": 2 * longest}))
    a, result_a, grads_a = _first_step(rows_cfg, tmp_path / "a")
    b, result_b, grads_b = _first_step(tokens_cfg, tmp_path / "b")
    assert b.plan.micro_batch_tokens == 2 * longest and b.plan.effective_batch == 8
    step_rows = [row_length(r) for r in b.rows_for_step(1)]
    groups = split_by_tokens(step_rows, 2 * longest)
    assert sorted(len(g) for g in groups) != [2, 2, 2, 2]  # really another split than 4 x 2 rows
    assert abs(result_a["loss"] - result_b["loss"]) < 1e-6
    assert result_a["units"] == result_b["units"]
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name, g in grads_a.items():
        torch.testing.assert_close(grads_b[name], g, rtol=0, atol=1e-6)


def test_a_budget_below_the_longest_row_names_its_length(run):
    cfg = Config.from_dict(dict(run, training={**run["training"], "micro_batch_tokens": 8}))
    lengths = read_lengths(cfg)
    with pytest.raises(ConfigError) as err:
        plan_run(cfg, device="cpu", lengths=lengths)
    assert err.value.message == (f"training.micro_batch_tokens 8 is below the longest training row "
                                 f"({lengths.longest} tokens)")


def test_the_planner_picks_the_budget(run):
    cfg = Config.from_dict(dict(run, training={**run["training"], "micro_batch_tokens": "auto"}))
    lengths = read_lengths(cfg)
    free = plan_run(cfg, device="cpu", lengths=lengths)
    assert free.micro_batch_tokens == 8 * lengths.longest  # no budget: the whole step in one micro-batch
    assert free.grad_accum == 1 and free.effective_batch == 8
    smallest = plan_run(Config.from_dict(dict(run, training={**run["training"], "micro_batch_tokens": lengths.longest})),
                        device="cpu", lengths=lengths, budget_bytes=None)
    between = (smallest.peak_bytes + free.peak_bytes) // 2
    fitted = plan_run(cfg, device="cpu", lengths=lengths, budget_bytes=int(between / 0.9))
    assert lengths.longest <= fitted.micro_batch_tokens < free.micro_batch_tokens
    assert fitted.peak_bytes <= between
    split = lengths.token_split(fitted.micro_batch_tokens)
    assert fitted.micro_batch_tokens_max == split.largest.tokens <= fitted.micro_batch_tokens
