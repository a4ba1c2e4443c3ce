"""`maximus.patch` on a model called directly: the loss equals Transformers' own (plain, LoRA,
DoRA), gradients too, no logits unless asked, `num_items_in_batch` honoured, TRL's fused-head
protocol served with TRL's own kernel as the oracle, and `unpatch` restoring the model."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import lora_model

import maximus
from maximus.errors import ConfigError


def _batch(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, 40), generator=g)
    labels = ids.clone()
    labels[:, :12] = -100  # a prompt without loss
    labels[1, 30:] = -100  # right padding
    return ids, labels


def _grads(model):
    return [p.grad for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("kind", ["plain", "lora", "dora", "qlora"])
def test_loss_and_grads_equal_transformers(tiny_llama, kind):
    if kind == "plain":
        from transformers import AutoModelForCausalLM

        ours = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    else:
        ours = lora_model(tiny_llama, dora=kind == "dora", init=False, qlora=kind == "qlora")
    theirs = copy.deepcopy(ours)
    maximus.patch(ours, seq_len=64)
    if kind == "qlora":  # prepare_model_for_kbit_training turned Transformers' checkpointing on: now ours
        assert not any(layer.gradient_checkpointing for layer in ours.get_base_model().model.layers)
    ids, labels = _batch(ours.config.vocab_size)
    for num_items in (None, torch.tensor(23)):
        ours.zero_grad(), theirs.zero_grad()
        out = ours(input_ids=ids, labels=labels, num_items_in_batch=num_items)
        ref = theirs(input_ids=ids, labels=labels, num_items_in_batch=num_items)
        assert out.logits is None
        assert abs(out.loss.item() - ref.loss.item()) <= 1e-5
        out.loss.backward(), ref.loss.backward()
        for a, b in zip(_grads(ours), _grads(theirs)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    if kind == "plain":  # positional arguments bind by the model's own signature
        assert abs(ours(ids, None, None, None, None, labels).loss.item() - theirs(input_ids=ids, labels=labels).loss.item()) <= 1e-5
    with_logits = ours(input_ids=ids, labels=labels, return_logits=True)
    assert with_logits.logits.shape == (2, 40, ours.config.vocab_size)
    assert ours(input_ids=ids).logits.shape == (2, 40, ours.config.vocab_size)  # no labels: the model's own forward


def test_all_masked_batch_gives_zero(tiny_llama):
    model = maximus.patch(lora_model(tiny_llama, init=False), seq_len=64)
    ids, _ = _batch(model.config.vocab_size)
    out = model(input_ids=ids, labels=torch.full_like(ids, -100), num_items_in_batch=torch.tensor(0))
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert all(torch.count_nonzero(g) == 0 for g in _grads(model))


def test_unpatch_restores_the_model(tiny_llama):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaForCausalLM

    model = lora_model(tiny_llama)
    lm = model.get_base_model()
    maximus.patch(model, gradient_checkpointing="full", seq_len=64)
    assert type(lm).__name__ == "LlamaForCausalLM" and type(lm) is not LlamaForCausalLM
    assert maximus.patch_report(model).checkpointing == ["full", "full"]
    maximus.unpatch(model)
    assert type(lm) is LlamaForCausalLM and maximus.patch_report(model) is None
    assert all(type(layer) is LlamaDecoderLayer for layer in lm.model.layers)
    assert lm.config._attn_implementation == "sdpa"
    ids, labels = _batch(lm.config.vocab_size)
    assert model(input_ids=ids, labels=labels).logits is not None


def test_fused_lm_head_served_like_trl(tiny_llama):
    """TRL's `add_fused_lm_head` on an unpatched copy is the oracle; on the patched model (before
    or after patching) the same call is served by our head, and TRL's forward is not installed."""
    from trl.trainer.utils import add_fused_lm_head

    outputs = ("log_probs", "entropy", "mean_logits", "is_top1", "log_sum_sq_probs")
    theirs = lora_model(tiny_llama, init=False)
    before, after = copy.deepcopy(theirs), copy.deepcopy(theirs)
    add_fused_lm_head(theirs.get_base_model(), temperature=0.7, outputs=outputs)
    add_fused_lm_head(before.get_base_model(), temperature=0.7, outputs=outputs)
    maximus.patch(before, seq_len=64)
    maximus.patch(after, seq_len=64)
    add_fused_lm_head(after.get_base_model(), temperature=0.7, outputs=outputs)
    ids, labels = _batch(theirs.config.vocab_size)
    pos = torch.cat([torch.arange(25), torch.arange(15)]).expand(2, -1)  # two packed documents per row
    ref = theirs(input_ids=ids, position_ids=pos, labels=labels, fused_lm_head=True)
    (-ref.log_probs.sum() + ref.entropy.sum()).backward()
    for model in (before, after):
        lm = model.get_base_model()
        assert "forward" not in lm.__dict__
        assert maximus.patch_report(model).notices[-1] == (
            "maximus.patch: TRL's fused LM head (log_probs, entropy, mean_logits, is_top1, log_sum_sq_probs) is served "
            "by Maximus's chunked exact head; TRL's own head is not installed")
        out = model(input_ids=ids, position_ids=pos, labels=labels, fused_lm_head=True)
        for name in outputs[:-1] + ("log_sum_sq_probs",):
            torch.testing.assert_close(getattr(out, name).float(), getattr(ref, name).float(), atol=2e-5, rtol=1e-5)
        assert torch.equal(out.label_mask, ref.label_mask)
        assert abs(out.loss.item() - ref.loss.item()) <= 1e-5
        (-out.log_probs.sum() + out.entropy.sum()).backward()
        for a, b in zip(_grads(model), _grads(theirs)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    maximus.unpatch(after)  # TRL asked for its head: it gets it back, as TRL's own forward
    assert after.get_base_model().__dict__["forward"].__func__.__code__.co_name == "_fused_forward"


def test_target_vram_sizes_checkpointing_and_chunk(tiny_llama):
    model = lora_model(tiny_llama)
    maximus.patch(model, target_vram=10**9, seq_len=64)
    report = maximus.patch_report(model)
    assert report.plan is not None and report.plan.budget_bytes == 10**9
    assert report.chunk_size == report.plan.loss_chunk_size
    assert report.checkpointing == list(report.plan.recompute)  # the plan's per-layer modes, applied


def test_bad_options_are_one_line_errors(tiny_llama):
    model = lora_model(tiny_llama)
    with pytest.raises(ConfigError) as err:
        maximus.patch(model, loss="ghost")
    assert str(err.value) == "maximus.patch: unknown loss 'ghost' (hint: use loss='exact' or loss='off')"
    with pytest.raises(ConfigError) as err:
        maximus.patch(model, gradient_checkpointing="half")
    assert str(err.value) == ("maximus.patch: unknown gradient_checkpointing 'half' (hint: use auto, none, full, "
                              "selective, True/False, or one of none/selective/full per layer)")
