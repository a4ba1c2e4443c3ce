"""DPO through the real trainer on a tiny random Llama with real PEFT LoRA.

Oracles: Transformers' own logits (log_softmax + gather) for the sequence log-probs, PEFT's
`disable_adapter()` forward for the reference, and log 2 for the first DPO step (policy equal to
reference when LoRA B starts at zero).
"""
import json
import math
import random
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import maximus
from maximus.data import build_datasets, collate
from maximus.errors import ConfigError
from maximus.losses.preference import PreferenceLoss, dpo_loss
from maximus.memory import plan_run
from maximus.train.objectives.preference import CACHE_FILE, PreferenceObjective, pair_keys
from maximus.structure import row_lengths
from tiny import build_tiny_model_dir, one_thread  # noqa: F401  (one_thread: a fixture, used through pytestmark)

WORDS = "apple banana cherry grape lemon mango olive peach pear plum river stone cloud storm".split()


def pairs(n, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = rng.sample(WORDS, rng.randint(2, 4))
        # The preferred answer starts with "yes": a pattern a tiny model learns in a few steps.
        out.append({"prompt": f"Reverse: {' '.join(words)}\nAnswer:", "chosen": " yes " + " ".join(reversed(words)),
                    "rejected": " no " + " ".join(words)})
    return out


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama + tokenizer saved to disk, and a jsonl of preference pairs."""
    root = tmp_path_factory.mktemp("dpo")
    records = pairs(40)
    build_tiny_model_dir(root / "model", hidden=32, heads=2, kv_heads=1, max_positions=64,
                         texts=[r["prompt"] + r["chosen"] for r in records])
    data = root / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return root


def config(tiny, out, **over):
    d = {"model": str(tiny / "model"), "dataset": {"path": str(tiny / "pairs.jsonl"), "format": "preference"},
         "method": "lora", "objective": "dpo", "output_dir": str(out), "device": "cpu",
         "lora": {"r": 4, "alpha": 8, "target_modules": "all-linear"},
         "optimization": {"target_vram": None, "gradient_checkpointing": "off"},
         "training": {"batch_size": 4, "micro_batch_size": 2, "max_steps": 4, "learning_rate": 1e-2,
                      "warmup_steps": 0, "scheduler": "constant", "seq_len": 32, "dtype": "fp32"},
         "eval": {"split": 0.2},
         "logging": {"progress": "none"}}
    for key, value in over.items():
        section, _, name = key.partition(".")
        if name:
            d.setdefault(section, {})[name] = value
        else:
            d[key] = value
    return maximus.Config.from_dict(d)


def metrics_rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_dpo_lora_adapter_off_first_step_is_log2_and_rewards_are_logged(tiny, tmp_path):
    summary = maximus.Trainer(config(tiny, tmp_path)).train()
    rows = [r for r in metrics_rows(tmp_path) if "loss" in r]
    assert len(rows) == 4
    # Zero-initialised LoRA B: policy == reference (adapter off), so every pair's loss is log 2.
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert rows[0]["rewards/chosen"] == rows[0]["rewards/rejected"] == 0.0
    assert rows[0]["rewards/accuracy"] == 0.0
    for row in rows:
        assert set(row) >= {"rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy"}
        assert row["rewards/margin"] == pytest.approx(row["rewards/chosen"] - row["rewards/rejected"], abs=1e-9)
    assert rows[-1]["loss"] < math.log(2)
    before, after = summary["eval"]["before"], summary["eval"]["after"]
    assert before["pairs"] == after["pairs"] == 8
    assert before["loss"] == pytest.approx(math.log(2), abs=1e-6) and before["rewards/margin"] == 0.0
    assert after["rewards/margin"] > 0 and after["rewards/accuracy"] > before["rewards/accuracy"]
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert not (tmp_path / CACHE_FILE).exists()


def _manual_logps(model, ids, labels):
    """Sum of log p(label) over labelled tokens from Transformers' full logits."""
    logits = model(input_ids=ids).logits.float()
    target = labels[:, 1:]
    logp = F.log_softmax(logits[:, :-1], dim=-1)
    mask = target != -100
    picked = logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * mask).sum(-1)


@pytest.mark.parametrize("loss_type,mode", [("sigmoid", "exact"), ("ipo", "exact"), ("simpo", "exact"),
                                            ("orpo", "exact"), ("hinge", "naive")])
def test_loss_sum_matches_transformers_logits_and_peft_disable_adapter(tiny, loss_type, mode):
    cfg = config(tiny, tiny / "unused", **{"dpo": {"loss": loss_type, "beta": 0.5}})
    model, tok = maximus.load_model(cfg, device=torch.device("cpu"), method="lora")
    torch.manual_seed(1)
    with torch.no_grad():  # a non-zero adapter, so policy and reference differ
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    data = build_datasets(cfg.datasets, tok, seq_len=32, objective="dpo", eval_split=0.0)
    rows = data.train[:3]
    batch = collate(rows, tok.pad_token_id)
    plan = replace(plan_run(cfg, device="cpu"), micro_batch_size=3, loss_chunk_size=5, loss_mode=mode)
    objective = PreferenceObjective(cfg, plan, tok.pad_token_id)
    loss_sum, sums = objective.loss_sum(model, batch)

    # One sequence at a time, unpadded: no padding can leak into the oracle.
    def side(key):
        out = {"policy": [], "ref": [], "n": []}
        for row in rows:
            ids, labels = torch.tensor([row[f"{key}_input_ids"]]), torch.tensor([row[f"{key}_labels"]])
            out["policy"].append(_manual_logps(model, ids, labels))
            with model.disable_adapter():
                out["ref"].append(_manual_logps(model, ids, labels))
            out["n"].append(int((labels[:, 1:] != -100).sum()))
        return {k: torch.cat(v) if k != "n" else torch.tensor(v) for k, v in out.items()}

    c, r = side("chosen"), side("rejected")
    want, wc, wr = dpo_loss(c["policy"].double(), r["policy"].double(), c["ref"].double(), r["ref"].double(),
                            PreferenceLoss(loss_type=loss_type, beta=0.5), reduction="none",
                            chosen_lengths=c["n"], rejected_lengths=r["n"])
    # float32 sums of ~60 nats cancel in policy - reference: agree to ~1e-6 x 60 per pair.
    assert float(loss_sum) == pytest.approx(float(want.sum()), rel=1e-5, abs=5e-5)
    assert float(sums["rewards/chosen"]) == pytest.approx(float(wc.sum()), rel=1e-5, abs=5e-5)
    assert float(sums["rewards/margin"]) == pytest.approx(float((wc - wr).sum()), rel=1e-5, abs=5e-5)
    assert float(sums["rewards/accuracy"]) == float((wc > wr).sum())
    loss_sum.backward()  # gradients reach the adapter only
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)
    assert objective.count(batch) == 3
    assert objective.tokens(batch) == sum(len(row[k]) for row in rows for k in ("chosen_input_ids", "rejected_input_ids"))


def test_full_finetune_with_precomputed_reference_caches_and_reuses(tiny, tmp_path):
    cfg = config(tiny, tmp_path, method="full", dpo={"reference": "precomputed"},
                 **{"training.max_steps": 2, "training.learning_rate": 1e-3})
    trainer = maximus.Trainer(cfg)
    summary = trainer.train()
    assert not trainer.objective.cache_reused and (tmp_path / CACHE_FILE).is_file()
    # Every train and eval pair, keyed by content: a repeated pair shares one entry.
    assert len(trainer.objective.cache) == len({json.dumps(r) for r in pairs(40)}) == 39
    rows = [r for r in metrics_rows(tmp_path) if "loss" in r]
    # Reference = the model before step 1 (batches padded differently: equal to float32 rounding).
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert abs(rows[0]["rewards/margin"]) < 1e-5
    assert summary["eval"]["before"]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    again = maximus.Trainer(cfg)  # same command again: resumes at the end and reuses the cache
    again.train()
    assert again.objective.cache_reused


def test_dpo_on_top_of_an_sft_adapter(tiny, tmp_path):
    """init_adapter: `precomputed` references the SFT model itself (first loss log 2); `adapter_off`
    references the base without it (first loss differs)."""
    maximus.Trainer(config(tiny, tmp_path / "sft", objective="sft", eval={"enabled": False},
                           **{"training.max_steps": 8})).train()
    adapter = str(tmp_path / "sft" / "adapter")
    first = {}
    for reference in ("precomputed", "adapter_off"):
        out = tmp_path / reference
        maximus.Trainer(config(tiny, out, init_adapter=adapter, dpo={"reference": reference},
                               eval={"enabled": False}, **{"training.max_steps": 1})).train()
        first[reference] = metrics_rows(out)[0]["loss"]
    assert first["precomputed"] == pytest.approx(math.log(2), abs=1e-5)
    assert abs(first["adapter_off"] - math.log(2)) > 1e-3


def test_adapter_off_without_an_adapter_is_a_config_error(tiny, tmp_path):
    with pytest.raises(ConfigError) as err:
        maximus.Trainer(config(tiny, tmp_path, method="full")).train()
    assert str(err.value) == ("dpo.reference: adapter_off needs an adapter to switch off, but method is full "
                              "(hint: set dpo.reference: precomputed (reference log-probs computed once and cached))")


def test_approximate_or_sft_only_losses_are_refused(tiny, tmp_path):
    with pytest.raises(ConfigError) as err:
        PreferenceObjective(config(tiny, tmp_path, optimization={"use_ghost_logit": True}), {}, 1)
    assert str(err.value) == ("optimization.use_ghost_logit does not apply to objective dpo (hint: set "
                              "use_ghost_logit: false; DPO's exact log-probs already hold no full logits)")
    with pytest.raises(ConfigError) as err:
        PreferenceObjective(config(tiny, tmp_path, optimization={"matryoshka": {"dims": [16]}}), {}, 1)
    assert str(err.value) == ("optimization.matryoshka does not apply to objective dpo "
                              "(hint: remove optimization.matryoshka (it is an SFT auxiliary loss))")


def test_pair_keys_ignore_padding_and_row_lengths():
    rows = [{"chosen_input_ids": [5, 6, 7], "chosen_labels": [-100, 6, 7],
             "rejected_input_ids": [5, 8], "rejected_labels": [-100, 8]},
            {"chosen_input_ids": [5, 6, 7, 9, 9], "chosen_labels": [-100, 6, 7, 9, 9],
             "rejected_input_ids": [5], "rejected_labels": [-100]}]
    alone, together = collate(rows[:1], 1), collate(rows, 1)
    assert pair_keys(alone)[0] == pair_keys(together)[0] != pair_keys(together)[1]
    assert row_lengths(together["chosen_position_ids"]).tolist() == [3, 5]
    assert row_lengths(together["rejected_position_ids"]).tolist() == [2, 1]
