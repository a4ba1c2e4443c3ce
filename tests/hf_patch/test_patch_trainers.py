"""`maximus.patch` unchanged under the real trainers: TRL SFTTrainer (packing, completion-only
loss), TRL DPOTrainer (adapter-off reference), HF Trainer (with resume_from_checkpoint), their
gradient_checkpointing=True (no double recompute) and save_pretrained (the adapter as PEFT's).
Each run is compared step by step with the same run without the patch (fp32)."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import lora_model, preference_rows, prompt_completion_rows

import maximus

COMMON = dict(per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1, report_to=[], seed=0,
              use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)


def _losses(trainer) -> list[dict]:
    return [h for h in trainer.state.log_history if "loss" in h]


def _mlp_calls(model) -> list[int]:
    """Counts calls of every layer's MLP: a recompute in backward calls it again."""
    calls = [0]
    for layer in model.get_base_model().model.layers:
        layer.mlp.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _sft(model_dir, tmp_path, patched: bool, name: str):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    model = lora_model(model_dir)
    if patched:
        maximus.patch(model, gradient_checkpointing="full", seq_len=64)
    calls = _mlp_calls(model)
    args = SFTConfig(output_dir=str(tmp_path / name), max_steps=3, packing=True, max_length=64,
                     completion_only_loss=True, gradient_checkpointing=True, **COMMON)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(prompt_completion_rows()),
                         processing_class=AutoTokenizer.from_pretrained(model_dir))
    trainer.train()
    return trainer, calls[0]


def test_sft_trainer_packing_completion_only(tiny_llama, tmp_path, capsys):
    theirs, their_calls = _sft(tiny_llama, tmp_path, False, "plain")
    ours, our_calls = _sft(tiny_llama, tmp_path, True, "patched")
    assert "forward" not in ours.model.get_base_model().__dict__  # TRL's head is not installed
    notices = maximus.patch_report(ours.model).notices
    assert notices[-2:] == [
        "maximus.patch: TRL's fused LM head (log_probs, entropy, is_top1) is served by Maximus's chunked exact "
        "head; TRL's own head is not installed",
        "maximus.patch: the trainer's gradient_checkpointing is served by Maximus's checkpointing (full on all 2 "
        "layers); Transformers' own recompute stays off, so no layer is recomputed twice"]
    assert "notice: " + notices[-1] in capsys.readouterr().err
    # one forward + one recompute per layer per step, as with Transformers' own checkpointing: never two
    assert our_calls == their_calls == 3 * 2 * 2
    for a, b in zip(_losses(ours), _losses(theirs), strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-4
        assert abs(a["entropy"] - b["entropy"]) <= 1e-4  # TRL's metrics are kept
        assert a["mean_token_accuracy"] == pytest.approx(b["mean_token_accuracy"], abs=1e-6)
        assert a["num_tokens"] == b["num_tokens"]


def _dpo(model_dir, tmp_path, patched: bool, name: str):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    model = lora_model(model_dir)
    if patched:
        maximus.patch(model, seq_len=64)
    args = DPOConfig(output_dir=str(tmp_path / name), max_steps=3, max_length=64, beta=0.1, **COMMON)
    trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(preference_rows()),
                         processing_class=AutoTokenizer.from_pretrained(model_dir))
    trainer.train()
    return trainer


def test_dpo_trainer_adapter_off_reference(tiny_llama, tmp_path):
    theirs = _dpo(tiny_llama, tmp_path, False, "plain")
    ours = _dpo(tiny_llama, tmp_path, True, "patched")
    assert "forward" not in ours.model.get_base_model().__dict__
    rows = list(zip(_losses(ours), _losses(theirs), strict=True))
    assert len(rows) == 3
    for a, b in rows:
        for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
            assert abs(a[key] - b[key]) <= 1e-4, key
    assert rows[-1][0]["loss"] != rows[0][0]["loss"]  # it trained


LENGTH = 40


def _hf_rows(model_dir, n: int = 32) -> list[dict]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = []
    for r in prompt_completion_rows(n):
        prompt = tok(r["prompt"]).input_ids
        full = tok(r["prompt"] + r["completion"]).input_ids[:LENGTH]
        full += [tok.pad_token_id] * (LENGTH - len(full))
        labels = [-100] * len(prompt) + full[len(prompt):]
        labels = [t if t != tok.pad_token_id else -100 for t in labels]
        rows.append({"input_ids": full, "labels": labels[:LENGTH], "attention_mask": [int(t != tok.pad_token_id) for t in full]})
    return rows


def _hf_trainer(model, out, rows, **kw):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(out), **{**COMMON, "max_steps": 4, "gradient_accumulation_steps": 2, **kw})
    return Trainer(model=model, args=args, train_dataset=Dataset.from_list(rows))


def test_hf_trainer_resume_and_save_pretrained(tiny_llama, tmp_path):
    from safetensors.torch import load_file

    rows = _hf_rows(tiny_llama)
    theirs = _hf_trainer(lora_model(tiny_llama), tmp_path / "plain", rows)
    theirs.train()
    model = maximus.patch(lora_model(tiny_llama), seq_len=LENGTH)
    ours = _hf_trainer(model, tmp_path / "patched", rows, save_strategy="steps", save_steps=2)
    ours.train()
    for a, b in zip(_losses(ours), _losses(theirs), strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5  # gradient accumulation: num_items_in_batch normalisation
    # resume from step 2 on a fresh patched model: the same last steps
    resumed = _hf_trainer(maximus.patch(lora_model(tiny_llama), seq_len=LENGTH), tmp_path / "patched", rows,
                          save_strategy="steps", save_steps=2)
    resumed.train(resume_from_checkpoint=str(tmp_path / "patched" / "checkpoint-2"))
    assert [h["loss"] for h in _losses(resumed)][-2:] == pytest.approx([h["loss"] for h in _losses(ours)][-2:], abs=1e-6)
    # save_pretrained: the adapter files as PEFT writes them for the unpatched model
    model.save_pretrained(tmp_path / "ours")
    plain = copy.deepcopy(maximus.unpatch(model))
    plain.save_pretrained(tmp_path / "peft")
    a, b = load_file(tmp_path / "ours" / "adapter_model.safetensors"), load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    def adapter_config(where):  # target_modules is a set, written in set order
        config = json.loads((tmp_path / where / "adapter_config.json").read_text())
        return {**config, "target_modules": sorted(config["target_modules"])}
    assert adapter_config("ours") == adapter_config("peft")
