"""Padding-free micro-batches (`maximus.data.flatten` + per-document attention) give the same
step as padded ones through Transformers' own SDPA path (the oracle)."""
from __future__ import annotations

import torch

from maximus import Config, Trainer
from maximus.data import collate, flatten
from tiny import tiny_config


def test_flatten_puts_rows_end_to_end():
    rows = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "position_ids": [0, 1, 2]},
            {"input_ids": [8, 9], "labels": [-100, 9], "position_ids": [0, 1]}]
    out = flatten(rows)
    assert out["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert out["labels"].tolist() == [[-100, 6, 7, -100, 9]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    padded = collate(rows, pad_token_id=0)
    assert padded["input_ids"].shape == (2, 3)  # what flattening saves: one padding token here


def _step(cfg: dict, padding_free: bool):
    grads = {}

    def keep_grads(trainer, step):  # the gradient itself: AdamW's first step is ~sign(grad), which
        for n, p in trainer.model.named_parameters():  # would magnify last-bit differences
            if p.requires_grad:
                grads[n] = p.grad.detach().clone()

    trainer = Trainer(Config.from_dict(cfg), hooks={"after_backward": keep_grads})
    trainer.setup()
    if not padding_free:  # the oracle: padded rows through Transformers' SDPA with its packed mask
        trainer.model.get_base_model().set_attn_implementation("sdpa")
        trainer.kernels.attention = "sdpa"
    seen = []
    original = trainer.objective.loss_sum

    def spy(model, batch):
        seen.append(tuple(batch["input_ids"].shape))
        return original(model, batch)

    trainer.objective.loss_sum = spy
    metrics = trainer.train_step(1)
    return metrics["loss"], grads, seen


def test_padding_free_step_equals_the_padded_step(tiny_llama, pc_data, tmp_path, monkeypatch):
    import maximus.attention.varlen as varlen

    monkeypatch.setattr(varlen, "MAX_SHORT_DOCUMENTS", 2)  # the micro-batch size: per-document attention
    cfg = tiny_config(tiny_llama, pc_data, tmp_path / "run", eval={"enabled": False},
                      training={"batch_size": 4, "micro_batch_size": 2, "max_steps": 1, "seq_len": 48,
                                "packing": False, "dtype": "fp32", "warmup_steps": 0, "max_grad_norm": None})
    loss_a, grads_a, shapes_a = _step(cfg, padding_free=True)
    loss_b, grads_b, shapes_b = _step(cfg, padding_free=False)
    assert all(shape[0] == 1 for shape in shapes_a) and all(shape[0] == 2 for shape in shapes_b)
    assert sum(s[1] for s in shapes_a) < sum(s[0] * s[1] for s in shapes_b)  # padding was dropped
    assert abs(loss_a - loss_b) < 1e-5
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-4, atol=1e-6)


def test_short_rows_stay_padded(tiny_llama, pc_data, tmp_path):
    cfg = tiny_config(tiny_llama, pc_data, tmp_path / "run", eval={"enabled": False},
                      training={"batch_size": 4, "micro_batch_size": 2, "max_steps": 1, "seq_len": 48,
                                "packing": False, "dtype": "fp32", "warmup_steps": 0})
    trainer = Trainer(Config.from_dict(cfg))
    trainer.setup()
    rows = trainer.rows_for_step(1)[:1] * 40  # 40 rows of ~15 tokens: too many short documents
    assert trainer.kernels.padding_free and not trainer._flatten(rows)
    assert trainer._flatten(rows[:32])  # few enough for one SDPA call each
    assert trainer._flatten([{**r, "input_ids": r["input_ids"] * 8} for r in rows])  # long enough
