"""`objective: contrastive` through the real trainer on a tiny random Llama with real PEFT LoRA.

Oracles: Transformers' own final hidden states of each unpadded text (pooling), and the textbook
InfoNCE (cosine logits / temperature, F.cross_entropy) computed per micro-batch for the first
step, where LoRA B = 0 makes the policy equal the base model.
"""
import json
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import maximus
from maximus.data import collate
from maximus.embed import embed, pooled_hidden_states
from maximus.errors import ConfigError
from maximus.train.objectives.contrastive import pooled_pairs
from tiny import build_tiny_model_dir, one_thread  # noqa: F401  (one_thread: a fixture, used through pytestmark)

WORDS = "apple banana cherry grape lemon mango olive peach pear plum river stone cloud storm".split()


def records(n, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = rng.sample(WORDS, 3)
        out.append({"query": "find " + " ".join(words), "positive": " ".join(reversed(words)) + " here"})
    return out


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("contrastive")
    data = records(48)
    build_tiny_model_dir(root / "model", hidden=32, heads=2, kv_heads=1, max_positions=64,
                         texts=[r["query"] + " " + r["positive"] for r in data])
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data), encoding="utf-8")
    return root


def config(tiny, out, **over):
    d = {"model": str(tiny / "model"), "dataset": str(tiny / "pairs.jsonl"), "objective": "contrastive",
         "method": "lora", "output_dir": str(out), "device": "cpu", "lora": {"r": 4, "alpha": 8},
         "optimization": {"gradient_checkpointing": "off", "matryoshka": {"dims": [8, 16], "weight": 0.5}},
         "training": {"batch_size": 8, "micro_batch_size": 4, "max_steps": 12, "learning_rate": 1e-2,
                      "warmup_steps": 0, "scheduler": "constant", "seq_len": 32, "dtype": "fp32"},
         "contrastive": {"temperature": 0.1, "pooling": "mean"},
         "eval": {"split": 0.25}, "logging": {"progress": "none"}}
    for key, value in over.items():
        section, _, name = key.partition(".")
        if name:
            d.setdefault(section, {})[name] = value
        else:
            d[key] = value
    return maximus.Config.from_dict(d)


def _oracle_vector(model, ids, pooling):
    with torch.no_grad():
        hidden = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    return hidden.mean(0) if pooling == "mean" else hidden[-1]


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_training_pooling_equals_embed_and_unpadded_transformers(tiny, pooling):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny / "model")).eval()
    tok = AutoTokenizer.from_pretrained(str(tiny / "model"))
    texts = [r for rec in records(3, seed=1) for r in (rec["query"], rec["positive"] + " and more words")]
    rows = [{"query_input_ids": tok(texts[i])["input_ids"], "positive_input_ids": tok(texts[i + 1])["input_ids"]}
            for i in range(0, len(texts), 2)]
    with torch.no_grad():
        q, p = pooled_pairs(model, collate(rows, tok.pad_token_id), pooling)
    expected_q = torch.stack([_oracle_vector(model, r["query_input_ids"], pooling) for r in rows])
    expected_p = torch.stack([_oracle_vector(model, r["positive_input_ids"], pooling) for r in rows])
    torch.testing.assert_close(q, expected_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(p, expected_p, rtol=1e-5, atol=1e-5)
    at_inference = pooled_hidden_states(model, tok, texts[0::2], pooling=pooling)
    torch.testing.assert_close(q, at_inference, rtol=1e-5, atol=1e-5)


def test_first_step_loss_is_info_nce_per_micro_batch(tiny, tmp_path):
    from maximus.train.trainer import Trainer

    trainer = Trainer(config(tiny, tmp_path / "run"))
    trainer.setup()
    rows = trainer.rows_for_step(1)
    base = trainer.model  # LoRA B starts at zero: the adapted model equals the base

    def direct(q, d):
        q, d = q.double(), d.double()
        logits = F.normalize(q, dim=-1) @ F.normalize(d, dim=-1).T / 0.1
        return F.cross_entropy(logits, torch.arange(q.shape[0]), reduction="sum")

    total = 0.0
    for start in (0, 4):  # micro-batches of 4: negatives come from the same micro-batch only
        micro = rows[start:start + 4]
        q = torch.stack([_oracle_vector(base, r["query_input_ids"], "mean") for r in micro])
        d = torch.stack([_oracle_vector(base, r["positive_input_ids"], "mean") for r in micro])
        total += float(direct(q, d) + 0.5 * (direct(q[:, :8], d[:, :8]) + direct(q[:, :16], d[:, :16])) / 2)
    result = trainer.train_step(1)
    assert result["units"] == 8
    assert result["loss"] == pytest.approx(total / 8, rel=1e-5)
    assert 0 <= result["metrics"]["accuracy"] <= 1


def test_training_improves_held_out_retrieval_and_embed_cli_uses_the_run_pooling(tiny, tmp_path):
    from maximus.embed_command import embed_main, load_model_and_tokenizer

    out = tmp_path / "run"
    summary = maximus.Trainer(config(tiny, out, **{"contrastive.pooling": "last"})).train()
    before, after = summary["eval"]["before"], summary["eval"]["after"]
    assert before["pairs"] == after["pairs"] == 12
    assert set(after) == {"loss", "accuracy", "pairs", "recall@1", "recall@10", "recall@1/8d", "recall@10/8d",
                          "recall@1/16d", "recall@10/16d"}
    assert after["loss"] < before["loss"]
    assert after["recall@1"] > before["recall@1"]
    texts = tmp_path / "texts.txt"
    texts.write_text("find apple pear plum\nplum pear apple here\n", encoding="utf-8")
    assert embed_main([str(out), "--input", str(texts), "--out", str(tmp_path / "v.npy"), "--dim", "16"]) == 0
    model, tok = load_model_and_tokenizer(out)
    expected = embed(model, tok, ["find apple pear plum", "plum pear apple here"], dim=16, pooling="last")
    np.testing.assert_allclose(np.load(tmp_path / "v.npy"), expected.numpy(), rtol=1e-5, atol=1e-6)


def test_ghost_logit_is_refused(tiny, tmp_path):
    from maximus.train.objectives.contrastive import ContrastiveObjective

    cfg = config(tiny, tmp_path / "run", **{"optimization.use_ghost_logit": True})
    with pytest.raises(ConfigError) as err:
        ContrastiveObjective(cfg, {"micro_batch_size": 4}, pad_token_id=1)
    assert str(err.value) == ("optimization.use_ghost_logit does not apply to objective contrastive "
                              "(hint: set use_ghost_logit: false; the contrastive loss has no vocabulary softmax)")
