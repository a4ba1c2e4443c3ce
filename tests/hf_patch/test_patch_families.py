"""`maximus.patch` under TRL's SFTTrainer on every family of the matrix (tests/models/test_families.py):
the same tiny random model with the same LoRA adapter, trained 2 steps with and without the patch,
logs the same losses (Gemma's final soft-cap, Granite's logit scaling and the mixture-of-experts
router loss included) and the same metrics, and the patch served TRL's fused head itself."""
from __future__ import annotations

import gc

import pytest
import torch
from conftest import prompt_completion_rows

import maximus
from tiny import FAMILY_FIELDS, build_family_model_dir

FAMILIES = list(FAMILY_FIELDS)
MOE = ("qwen3_moe", "mixtral", "gpt_oss")
COMMON = dict(per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1, report_to=[], seed=0,
              use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
              max_steps=2, max_length=64, completion_only_loss=True)


@pytest.fixture(scope="module", autouse=True)
def _frozen_gc():
    """Every `Trainer.train` ends in accelerate's `gc.collect()`, which walks all the objects the
    imports made (1.4 s a call here); frozen, they are skipped."""
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("patch-families")
    return lambda model_type: (root / model_type if (root / model_type).exists()
                               else build_family_model_dir(root / model_type, model_type))


@pytest.fixture(scope="module")
def dataset(family_dirs):
    """Prompt-completion rows tokenized once (every family shares the test tokenizer)."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(family_dirs("llama"))
    rows = []
    for r in prompt_completion_rows(16):
        prompt, completion = tok(r["prompt"]).input_ids, tok(r["completion"]).input_ids
        rows.append({"input_ids": prompt + completion, "completion_mask": [0] * len(prompt) + [1] * len(completion)})
    return Dataset.from_list(rows), tok


def _lora_model(model_dir, **config):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from maximus.families import attention_implementation

    hf_config = AutoConfig.from_pretrained(model_dir, **config)
    model = AutoModelForCausalLM.from_pretrained(model_dir, config=hf_config, dtype=torch.float32,
                                                 attn_implementation=attention_implementation(hf_config)[0])
    torch.manual_seed(0)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0,
                                            init_lora_weights=False))  # a non-zero adapter from the start


def _sft(model_dir, dataset, tmp_path, patched: bool):
    from trl import SFTConfig, SFTTrainer

    rows, tok = dataset
    model = _lora_model(model_dir)
    if patched:
        maximus.patch(model, gradient_checkpointing="full", seq_len=64)
    args = SFTConfig(output_dir=str(tmp_path / ("patched" if patched else "plain")), **COMMON)
    trainer = SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tok)
    trainer.train()
    return trainer


@pytest.mark.parametrize("model_type", FAMILIES)
def test_sft_trainer_losses_equal_unpatched(family_dirs, dataset, tmp_path, model_type):
    model_dir = family_dirs(model_type)
    theirs = _sft(model_dir, dataset, tmp_path, patched=False)
    ours = _sft(model_dir, dataset, tmp_path, patched=True)
    report = maximus.patch_report(ours.model)
    assert report.loss == "exact", report.notices
    assert "forward" not in ours.model.get_base_model().__dict__  # TRL's head is not installed: ours serves it
    rows = list(zip([h for h in ours.state.log_history if "loss" in h],
                    [h for h in theirs.state.log_history if "loss" in h], strict=True))
    assert len(rows) == 2
    keys = ["loss", "entropy", "mean_token_accuracy", "num_tokens"] + (["aux_loss"] if model_type in MOE else [])
    for a, b in rows:
        for key in keys:
            assert a[key] == pytest.approx(b[key], abs=1e-4), key
    assert rows[1][0]["loss"] != rows[0][0]["loss"]  # it trained


@pytest.mark.parametrize("model_type", FAMILIES)
def test_patched_forward_loss_equals_transformers(family_dirs, model_type):
    """The plain `model(input_ids, labels=...)` call (HF Trainer's): loss and gradients equal the
    unpatched model's; a mixture of experts asked for its router logits adds its router loss and
    returns it as `aux_loss`, as Transformers does."""
    model = _lora_model(family_dirs(model_type), **({"output_router_logits": True} if model_type in MOE else {}))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (2, 24), generator=g)
    labels = ids.clone()
    labels[:, :6] = -100
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0  # padding: the router loss counts only attended tokens
    trainable = [p for p in model.parameters() if p.requires_grad]
    theirs = model(input_ids=ids, attention_mask=mask, labels=labels)
    their_grads = torch.autograd.grad(theirs.loss, trainable)
    maximus.patch(model, gradient_checkpointing="off")
    assert maximus.patch_report(model).loss == "exact"
    ours = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert ours.logits is None
    our_grads = torch.autograd.grad(ours.loss, trainable)
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=0, atol=1e-5)
    for a, b in zip(our_grads, their_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    if model_type in MOE:
        assert float(theirs.aux_loss) > 0
        torch.testing.assert_close(ours.aux_loss, theirs.aux_loss, rtol=1e-6, atol=0)
