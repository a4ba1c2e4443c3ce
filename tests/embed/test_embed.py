"""Matryoshka embeddings: pooling against Transformers' own hidden states, the nested-prefix
identity, coarse-to-fine search against exact search, and the `maximus embed` command."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from maximus.embed import embed, exact_search, nested_prefix, pooled_hidden_states, search
from maximus.errors import ConfigError, DataError, ModelError

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paris", "What is two plus two? Two plus two is four.",
         "Once upon a time there was a little cat.", "a b c"]


@pytest.fixture(scope="module")
def tokenizer():
    from maximus.data.tiny_tokenizer import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def model_dir(model, tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return path


def _oracle(model, tokenizer, text, pooling):
    """Transformers' own final hidden states (after the final norm) of one unpadded text."""
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0]
    return hidden.mean(0) if pooling == "mean" else hidden[-1]


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_pooling_matches_unpadded_transformers_hidden_states(model, tokenizer, pooling):
    # batch_size=2 pads texts of different lengths together: padding must not leak in.
    pooled = pooled_hidden_states(model, tokenizer, TEXTS, pooling=pooling, batch_size=2)
    expected = torch.stack([_oracle(model, tokenizer, t, pooling) for t in TEXTS])
    torch.testing.assert_close(pooled, expected, rtol=1e-5, atol=1e-5)
    out = embed(model, tokenizer, TEXTS, pooling=pooling, batch_size=2)
    assert out.shape == (5, 32) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.normalize(expected, dim=-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.norm(dim=-1), torch.ones(5))


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_prefix_embedding_is_normalised_prefix_of_full(model, tokenizer, pooling):
    full = pooled_hidden_states(model, tokenizer, TEXTS, pooling=pooling)
    for dim in (1, 8, 16, 32):
        small = embed(model, tokenizer, TEXTS, dim=dim, pooling=pooling)
        assert small.shape == (5, dim)
        assert torch.equal(small, F.normalize(full[:, :dim], dim=-1))
    assert torch.equal(embed(model, tokenizer, TEXTS, pooling=pooling), F.normalize(full, dim=-1))


def test_embed_leaves_training_mode_and_checks_arguments(model, tokenizer):
    model.train()
    embed(model, tokenizer, TEXTS[:1])
    assert model.training
    model.eval()
    with pytest.raises(ConfigError) as err:
        embed(model, tokenizer, TEXTS, dim=33)
    assert str(err.value) == ("embedding dim 33 is outside 1..32 (the model's hidden size) "
                              "(hint: use a prefix size such as 64, or omit dim for all 32)")
    with pytest.raises(ConfigError, match="unknown pooling 'max'"):
        embed(model, tokenizer, TEXTS, pooling="max")
    with pytest.raises(DataError) as err:
        embed(model, tokenizer, ["fine", ""])
    assert str(err.value) == "text 1 is empty after tokenization (hint: remove empty texts before embedding)"


def _unit(n, width, seed):
    return F.normalize(torch.randn(n, width, generator=torch.Generator().manual_seed(seed)), dim=-1)


def test_exact_search_is_brute_force_topk():
    queries, index = _unit(300, 48, 1), _unit(500, 48, 2)  # 300 > QUERY_BLOCK: two blocks
    scores, indices = exact_search(queries, index, k=7)
    ref_scores, ref_indices = (queries @ index.T).topk(7, dim=1)
    assert torch.equal(indices, ref_indices)
    torch.testing.assert_close(scores, ref_scores)


def test_coarse_to_fine_with_whole_index_shortlist_equals_exact_search():
    queries, index = _unit(70, 96, 3), _unit(400, 96, 4)
    scores, indices = search(queries, index, k=10, shortlist_dim=16, shortlist=400)
    ref_scores, ref_indices = exact_search(queries, index, k=10)
    assert torch.equal(indices, ref_indices)
    torch.testing.assert_close(scores, ref_scores)


def test_coarse_to_fine_reranks_the_prefix_shortlist_by_full_scores():
    queries, index = _unit(40, 96, 5), _unit(400, 96, 6)
    prefix = nested_prefix(index, 16)
    scores, indices = search(queries, index, k=5, shortlist_dim=16, shortlist=20, index_prefix=prefix)
    _, candidates = exact_search(nested_prefix(queries, 16), prefix, k=20)
    full = queries @ index.T
    for q in range(40):
        # The answer is the best 5 of the 20 prefix candidates under the full inner product.
        cand = candidates[q]
        best = cand[full[q, cand].topk(5).indices]
        assert torch.equal(indices[q], best)
        torch.testing.assert_close(scores[q], full[q, best])


# ------------------------------------------------------------------------------------- the command
def test_command_on_model_dir_txt_and_jsonl(model, tokenizer, model_dir, tmp_path, capsys):
    from maximus.embed_command import embed_main

    txt = tmp_path / "texts.txt"
    txt.write_text("\n".join(TEXTS) + "\n")
    assert embed_main([str(model_dir), "--input", str(txt), "--out", str(tmp_path / "v.npy"), "--dim", "8"]) == 0
    expected = embed(model, tokenizer, TEXTS, dim=8)
    got = np.load(tmp_path / "v.npy")
    assert got.dtype == np.float32 and got.shape == (5, 8)
    np.testing.assert_allclose(got, expected.numpy(), rtol=1e-5, atol=1e-6)
    assert f"wrote {tmp_path / 'v.npy'}: 5 x 8 float32 (mean pooling, L2-normalised)" in capsys.readouterr().out

    jsonl = tmp_path / "texts.jsonl"
    jsonl.write_text("\n".join(json.dumps({"body": t, "id": i}) for i, t in enumerate(TEXTS)))
    assert embed_main([str(model_dir), "--input", str(jsonl), "--field", "body", "--out",
                       str(tmp_path / "sub" / "w"), "--pooling", "last"]) == 0
    np.testing.assert_allclose(np.load(tmp_path / "sub" / "w.npy"), embed(model, tokenizer, TEXTS, pooling="last").numpy(),
                               rtol=1e-5, atol=1e-6)


def test_command_on_run_dir_applies_the_adapter(model, tokenizer, model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model

    from maximus.config import Config
    from maximus.embed_command import embed_main

    run = tmp_path / "run"
    torch.manual_seed(1)
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                 init_lora_weights=False))
    peft_model.save_pretrained(str(run / "adapter"))
    tokenizer.save_pretrained(str(run / "adapter"))
    cfg = Config.from_dict({"model": str(model_dir), "dataset": "unused.jsonl"})
    (run / "run.json").write_text(json.dumps({"config": cfg.to_dict()}))
    txt = tmp_path / "texts.txt"
    txt.write_text("\n".join(TEXTS))
    assert embed_main([str(run), "--input", str(txt), "--out", str(tmp_path / "r.npy")]) == 0
    got = torch.from_numpy(np.load(tmp_path / "r.npy"))
    torch.testing.assert_close(got, embed(peft_model.eval(), tokenizer, TEXTS), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got, embed(model, tokenizer, TEXTS), atol=1e-3)  # the adapter did something


def test_command_user_errors(model_dir, tmp_path):
    from maximus.cli import main
    from maximus.embed_command import embed_main

    out = ["--out", str(tmp_path / "v.npy")]
    with pytest.raises(DataError) as err:
        embed_main([str(model_dir), "--input", str(tmp_path / "missing.txt"), *out])
    assert str(err.value) == (f"input file {tmp_path / 'missing.txt'} not found "
                              "(hint: pass --input a .txt (one text per line) or .jsonl file)")
    blank = tmp_path / "blank.txt"
    blank.write_text("one\n\nthree\n")
    with pytest.raises(DataError) as err:
        embed_main([str(model_dir), "--input", str(blank), *out])
    assert str(err.value) == (f"line 2 of {blank} is blank "
                              "(hint: remove blank lines: each line is one text and one row of the output)")
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text('{"text": "ok"}\n{"title": "no text"}\n')
    with pytest.raises(DataError) as err:
        embed_main([str(model_dir), "--input", str(jsonl), *out])
    assert str(err.value) == f"line 2 of {jsonl} has no string field 'text' (hint: choose the text field with --field)"
    good = tmp_path / "good.txt"
    good.write_text("hello\n")
    with pytest.raises(ModelError) as err:
        embed_main([str(tmp_path), "--input", str(good), *out])
    assert str(err.value) == (f"{tmp_path} is neither a Maximus run directory (run.json) nor a model directory "
                              "(config.json) (hint: pass a run's output_dir or a directory written by save_pretrained)")
    # Through the real CLI: a user error is one line and exit code 2; success is 0.
    assert main(["embed", str(model_dir), "--input", str(tmp_path / "missing.txt"), *out]) == 2
    assert main(["embed", str(model_dir), "--input", str(good), *out]) == 0
    assert np.load(tmp_path / "v.npy").shape == (1, 32)
