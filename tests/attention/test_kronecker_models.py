"""Kronecker Sketching attention inside whole models: causality, KV-cache generation, PEFT, errors."""
import copy

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from maximus.attention import KroneckerSketch, install_kronecker, kronecker_module_names
from maximus.config import KroneckerConfig
from maximus.errors import ConfigError, ModelError

SMALL = KroneckerConfig(detail_tokens=64, sketch_slots=16, block=16)


def _llama(layers=2):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


def _ids(n, batch=1, seed=0):
    return torch.randint(0, 97, (batch, n), generator=torch.Generator().manual_seed(seed))


def test_whole_model_is_causal_far_beyond_the_budget():
    model = install_kronecker(_llama(), SMALL)
    ids = _ids(640)
    t = 401
    changed = ids.clone()
    changed[:, t + 1:] = _ids(640 - t - 1, seed=1)
    with torch.no_grad():
        a = model(ids, use_cache=False).logits
        b = model(changed, use_cache=False).logits
    assert torch.equal(a[:, :t + 1], b[:, :t + 1])
    assert (a[:, t + 1:] - b[:, t + 1:]).abs().max() > 1e-3


def test_whole_model_gradient_at_t_ignores_the_future_in_training():
    model = install_kronecker(_llama(), SMALL).train()
    emb = model.get_input_embeddings()(_ids(512)).detach().requires_grad_(True)
    t = 300
    logits = model(inputs_embeds=emb, use_cache=False).logits
    logits[:, t].logsumexp(-1).sum().backward()
    assert torch.count_nonzero(emb.grad[:, t + 1:]) == 0
    assert torch.count_nonzero(emb.grad[:, :64]) > 0
    sketch = model.model.layers[0].self_attn.kronecker
    assert sketch.score_key.grad is not None and sketch.bucket_log_scale.grad.abs().sum() > 0


def test_greedy_generation_with_cache_equals_recomputation():
    # Blocks of 4 tokens: 60 tokens = 15 blocks, so decoding crosses many block boundaries with
    # selection and sketch slots active (budget 16 tokens).
    settings = KroneckerConfig(detail_tokens=16, sketch_slots=4, block=4)
    model = install_kronecker(_llama(), settings)
    prompt = _ids(20, batch=2, seed=3)
    mask = torch.ones_like(prompt)
    mask[1, :5] = 0  # left padding on the second row
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=mask, max_new_tokens=40, do_sample=False, use_cache=True,
                             pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        seq = out.sequences
        full_mask = torch.cat([mask, torch.ones(2, seq.shape[1] - 20, dtype=torch.long)], 1)
        full = model(seq, attention_mask=full_mask, use_cache=False).logits
    steps = torch.stack(out.scores, 1)  # [2, 40, V]: logits of each decoding step (with cache)
    recomputed = full[:, 19:-1]
    assert seq.shape[1] == 60 > 3 * settings.detail_tokens
    assert torch.equal(recomputed.argmax(-1), seq[:, 20:])
    torch.testing.assert_close(steps, recomputed, atol=1e-4, rtol=1e-4)


def test_peft_modules_to_save_trains_saves_and_reloads_the_sketch(tmp_path):
    base = install_kronecker(_llama(), SMALL)
    names = kronecker_module_names(base)
    assert names == ["model.layers.0.self_attn.kronecker", "model.layers.1.self_attn.kronecker"]
    fresh = copy.deepcopy(base)
    peft_model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=names))
    assert kronecker_module_names(peft_model) == ["base_model.model." + n for n in names]
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert any("kronecker.modules_to_save.default.score_query" in n for n in trainable)
    # One optimizer step on a long sequence moves the sketch parameters.
    peft_model.train()
    opt = torch.optim.SGD([p for p in peft_model.parameters() if p.requires_grad], lr=0.5)
    ids = _ids(256, seed=4)
    peft_model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    opt.step()
    peft_model.eval()
    trained = peft_model.base_model.model.model.layers[0].self_attn.kronecker.modules_to_save["default"]
    assert not torch.equal(trained.score_query, torch.eye(8))
    peft_model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert sum("kronecker" in k for k in saved) == 2 * 5  # 5 tensors per layer
    reloaded = PeftModel.from_pretrained(fresh, tmp_path).eval()
    with torch.no_grad():
        a = peft_model(ids, use_cache=False).logits
        b = reloaded(ids, use_cache=False).logits
    assert torch.equal(a, b)


def test_install_again_with_the_same_layout_keeps_the_sketches():
    model = install_kronecker(_llama(3), True)
    first = model.model.layers[0].self_attn.kronecker
    # detail_tokens 300 rounds down to the same 4 blocks of 64: the same layout.
    install_kronecker(model, KroneckerConfig(detail_tokens=300))
    assert model.model.layers[0].self_attn.kronecker is first
    assert sum(isinstance(m, KroneckerSketch) for m in model.modules()) == 3
    assert first.detail_tokens == 256 and first.slots == 64 and first.block == 64


def test_install_again_with_other_settings_is_a_model_error():
    model = install_kronecker(_llama(3), True)
    with pytest.raises(ModelError) as err:
        install_kronecker(model, SMALL)
    assert str(err.value) == (
        "model.layers.0.self_attn.kronecker is already installed with another layout (block=64, local_blocks=2, "
        "select_blocks=2, sub_slots=8, buckets=8) than these settings give (block=16, local_blocks=2, select_blocks=2, "
        "sub_slots=4, buckets=4) (hint: install on a fresh model, or pass the settings it was installed with)")
    # Under a PEFT wrapper the check reads the wrapped sketch.
    names = kronecker_module_names(model)
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=names))
    install_kronecker(peft_model, True)
    with pytest.raises(ModelError):
        install_kronecker(peft_model, SMALL)


def test_detail_budget_smaller_than_a_block_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        install_kronecker(_llama(), KroneckerConfig(detail_tokens=32, block=64))
    assert str(err.value) == ("optimization.kronecker_sketching.detail_tokens (32) must be at least block (64) "
                              "(hint: raise detail_tokens or lower block; detail_tokens is rounded down to whole blocks)")


def test_model_without_attention_registry_is_a_model_error():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(ModelError) as err:
        install_kronecker(gpt2, SMALL)
    assert str(err.value) == ("GPT2LMHeadModel does not route attention through Transformers' attention registry "
                              "(hint: use a Llama, Mistral or Qwen2-family model, or turn off "
                              "optimization.kronecker_sketching)")


def test_prepared_4d_mask_is_a_model_error():
    model = install_kronecker(_llama(), SMALL)
    mask4d = torch.ones(1, 1, 8, 8, dtype=torch.bool).tril()
    with pytest.raises(ModelError) as err:
        model(_ids(8), attention_mask=mask4d)
    assert str(err.value).startswith("Kronecker Sketching attention takes a 2D padding mask, not a prepared 4D mask")
