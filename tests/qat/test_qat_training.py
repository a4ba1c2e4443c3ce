"""Quantization-aware training on tiny random models: the weights a QAT run trains against are the
weights the export writes (bit for bit, read back from the GGUF file; K-quants through llama.cpp's
own quantiser), the forward and the straight-through gradient, the export's default type and
warning, scoring the export in llama.cpp, and the one-line refusals."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from maximus.cli import main
from maximus.config import Config
from maximus.errors import ConfigError
from maximus.qat.install import fake_quantized_weight, install_qat
from tiny import (LLAMA_CPP_MARKS, build_tiny_model_dir, llama_cpp_or_skip, one_thread,  # noqa: F401  (one_thread: a fixture)
                  tiny_config, write_prompt_completion)

llama_cpp_or_skip()  # the K-quant export and the deployed scoring run in llama.cpp

pytestmark = LLAMA_CPP_MARKS

#: (training.qat, method, tied head, hidden size): hidden 256 gives K-quant rows (256, 512 columns).
CASES = {"q4_0-lora": ("q4_0", "lora", False, 64), "q8_0-full": ("q8_0", "full", False, 64),
         "q4_k_m-lora-tied": ("q4_k_m", "lora", True, 256)}


def _train(root, target, method, tie, hidden, steps=2, hooks=None, **training):
    from maximus.train.trainer import Trainer

    model_dir = build_tiny_model_dir(root / "model", "llama", hidden=hidden, tie=tie)
    data = write_prompt_completion(root / "data.jsonl")
    cfg = tiny_config(model_dir, data, root / "run", method=method, eval={"split": 0.1, "before": False},
                      training={"max_steps": steps, "qat": target, **training})
    trainer = Trainer(Config.from_dict(cfg), hooks=hooks)
    trainer.train()
    return trainer


@pytest.fixture(scope="module", params=list(CASES))
def qat_run(request, tmp_path_factory):
    target, method, tie, hidden = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    trainer = _train(root, target, method, tie, hidden)
    out = root / "export.gguf"
    assert main(["export", str(root / "run"), "--format", "gguf", "--out", str(out)]) == 0  # --quant: the target
    return target, trainer, out


def test_trained_weights_equal_the_exported_gguf_bit_for_bit(qat_run):
    import gguf

    from maximus.export.gguf_arch import permute_for_llama_rope

    target, trainer, out = qat_run
    reader = gguf.GGUFReader(str(out))
    assert json.loads(bytes(reader.fields["maximus.export"].parts[-1]).decode())["quant"] == target
    in_file = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}
    lm = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, lm.config.num_hidden_layers)
    heads = {"q_proj": lm.config.num_attention_heads, "k_proj": lm.config.num_key_value_heads}
    compared, types = 0, set()
    for path, module in lm.named_modules():
        if path.endswith("base_layer") or (path == "lm_head" and lm.config.tie_word_embeddings):
            continue
        weight = fake_quantized_weight(module)
        if weight is None:
            continue
        name = names.get_name(path + ".weight", try_suffixes=(".weight",))
        leaf = path.rsplit(".", 1)[-1]
        if leaf in heads:  # llama.cpp's RoPE layout, as the export writes Q and K
            weight = permute_for_llama_rope(weight, heads[leaf])
        assert np.array_equal(weight.numpy(), np.asarray(in_file[name], np.float32).reshape(weight.shape)), name
        types.add(next(t.tensor_type.name for t in reader.tensors if t.name == name))
        compared += 1
    assert compared == 2 * 7 + 1 + (not lm.config.tie_word_embeddings)
    if target == "q4_k_m":  # llama.cpp's mixture: Q4_K, Q6_K on layer 1's attn_v / ffn_down and the tied embedding
        assert types == {"Q4_K", "Q6_K"}


def test_another_quant_is_exported_with_a_warning(qat_run, tmp_path, capsys):
    target, trainer, _ = qat_run
    if target != "q4_0":
        pytest.skip("one target shows it")
    run = trainer.run_dir
    assert main(["export", str(run), "--format", "gguf", "--quant", "q8_0", "--out", str(tmp_path / "q8.gguf")]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        f"warning: {run} was trained for q4_0 (training.qat); --quant q8_0 rounds its weights differently than it "
        f"trained for (omit --quant to write q4_0)")


def test_eval_scores_the_deployed_file_beside_the_model(qat_run, tmp_path, capsys):
    """An f32 export scored in llama.cpp equals the Transformers model's held-out loss."""
    target, trainer, _ = qat_run
    if target != "q8_0":
        pytest.skip("one run shows it")
    run, f32 = trainer.run_dir, tmp_path / "f32.gguf"
    assert main(["export", str(run), "--format", "gguf", "--quant", "f32", "--out", str(f32)]) == 0
    capsys.readouterr()
    assert main(["eval", str(run), "--gguf", str(f32), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    deployed = result["deployed"][0]
    assert deployed["quant"] == "f32" and deployed["tokens"] == result["after"]["tokens"] > 0
    assert deployed["loss"] == pytest.approx(result["after"]["loss"], rel=1e-4)
    assert main(["eval", str(run), "--gguf", str(f32)]) == 0
    assert capsys.readouterr().out.splitlines()[0].split() == ["base", "(before)", "tuned", "(after)", "deployed", "f32"]


def test_deployed_per_document_sums_equal_the_transformers_model(qat_run, tmp_path):
    """score_gguf(per_row=True): each held-out document's (loss sum, targets) from an f32 export in
    llama.cpp equals the Transformers model's on the same document; they add up to the reported loss."""
    from maximus.data import build_run_datasets
    from maximus.evaluate.deployed import _documents, score_gguf
    from maximus.export import load_tuned, run_config
    from maximus.structure import IGNORE_INDEX

    target, trainer, _ = qat_run
    if target != "q8_0":
        pytest.skip("one run shows it")
    run, f32 = trainer.run_dir, tmp_path / "f32.gguf"
    assert main(["export", str(run), "--format", "gguf", "--quant", "f32", "--out", str(f32)]) == 0
    model, tokenizer = load_tuned(run, dtype=torch.float32)
    rows = build_run_datasets(run_config(run), tokenizer, objective="sft").eval
    result = score_gguf(f32, tokenizer, rows, context=256, stops=[], per_row=True)
    expected = []
    with torch.no_grad():
        for ids, labels in (doc for row in rows for doc in _documents(row)):
            targets = torch.tensor(labels[1:])
            keep = targets != IGNORE_INDEX
            if keep.any():
                logits = model(input_ids=torch.tensor([ids])).logits[0, :-1][keep].double()
                expected.append([torch.nn.functional.cross_entropy(logits, targets[keep], reduction="sum").item(),
                                 int(keep.sum())])
    assert len(result["rows"]) == len(expected) > 1
    assert [n for _, n in result["rows"]] == [n for _, n in expected]
    np.testing.assert_allclose([s for s, _ in result["rows"]], [s for s, _ in expected], rtol=1e-4)
    assert sum(s for s, _ in result["rows"]) / result["tokens"] == pytest.approx(result["loss"], rel=1e-12)


def test_deployed_scoring_reuses_a_shared_prefix_without_changing_a_loss(qat_run, tmp_path):
    """Documents that begin alike (a chat template's system prompt) keep the common tokens' cache
    and logits between them: each loss equals the one from a fresh context, and so does a greedy
    completion after them; a repeated document and one that is a prefix of the last score alike."""
    from maximus.evaluate.deployed import LlamaCppModel

    target, trainer, _ = qat_run
    if target != "q8_0":
        pytest.skip("one run shows it")
    f32 = tmp_path / "f32.gguf"
    assert main(["export", str(trainer.run_dir), "--format", "gguf", "--quant", "f32", "--out", str(f32)]) == 0
    shared = [5, 9, 13, 2, 7, 11]
    docs = [shared + [3, 4, 8], shared + [6, 1], shared + [3, 4, 8], shared + [3], [4, 4, 2], shared + [6, 1, 12]]
    labels = [[-100] * 2 + d[2:] for d in docs]
    reused = LlamaCppModel(f32, context=64, threads=1)
    try:
        found = [reused.loss_sum(d, l) for d, l in zip(docs, labels)]
        assert reused.llm.n_tokens == len(docs[-1])
        completion = reused.complete([shared + [3]], max_new_tokens=4, stops=[], tokenizer=trainer.tokenizer)
    finally:
        reused.close()
    fresh = LlamaCppModel(f32, context=64, threads=1)
    try:
        expected = []
        for d, l in zip(docs, labels):
            fresh.llm.reset()  # an empty context: nothing to reuse
            expected.append(fresh.loss_sum(d, l))
        fresh.llm.reset()
        assert completion == fresh.complete([shared + [3]], max_new_tokens=4, stops=[], tokenizer=trainer.tokenizer)
    finally:
        fresh.close()
    assert [n for _, n in found] == [n for _, n in expected] == [len(d) - 2 for d in docs]
    np.testing.assert_allclose([s for s, _ in found], [s for s, _ in expected], rtol=1e-5)


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_lora_forward_uses_the_quantized_merged_weight(tmp_path, method):
    """In training mode a QAT LoRA layer computes x Q(W + s B A)^T (+ bias); in eval mode x (W + s B A)^T."""
    from maximus.models import load_model

    model_dir = build_tiny_model_dir(tmp_path / "model", "llama", hidden=64)
    cfg = Config.from_dict(tiny_config(model_dir, tmp_path / "d.jsonl", tmp_path / "run", method=method))
    model, _ = load_model(cfg, device=torch.device("cpu"), method=method)
    layer = model.get_base_model().model.layers[0].self_attn.q_proj
    torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.5)
    install_qat(model, "q4_0")
    x = torch.randn(3, 64)
    model.train()
    expected = x @ fake_quantized_weight(layer).T
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    model.eval()
    assert not torch.allclose(layer(x), expected, rtol=1e-3, atol=1e-3)
    # every layer rounds its own merged weight (the swapped class is shared by all 4-bit layers)
    model.train()
    for other in (model.get_base_model().model.layers[1].self_attn.k_proj, model.get_base_model().model.layers[0].mlp.down_proj):
        torch.nn.init.normal_(other.lora_B["default"].weight, std=0.5)
        h = torch.randn(3, other.in_features)
        torch.testing.assert_close(other(h), h @ fake_quantized_weight(other).T, rtol=1e-5, atol=1e-5)


def test_full_finetune_gradient_is_straight_through():
    """d loss / d W of a QAT linear is d loss / d Q(W), the gradient at the rounded weight."""
    from maximus.qat.install import _Rounding, _swap_class, gguf_rounding

    linear, twin = torch.nn.Linear(64, 8, bias=False), torch.nn.Linear(64, 8, bias=False)
    torch.nn.init.normal_(linear.weight, std=0.5)
    _swap_class(linear, _Rounding(gguf_rounding("q4_0", fp16_first=False)))
    with torch.no_grad():
        twin.weight.copy_(fake_quantized_weight(linear))
    x = torch.randn(5, 64)
    (linear(x) ** 2).sum().backward()
    (twin(x) ** 2).sum().backward()
    master = linear._parameters["weight"]  # `linear.weight` reads as the rounded weight
    assert torch.equal(master.grad, twin.weight.grad)
    assert not torch.equal(master, twin.weight)  # the master weight is kept, not rounded


def test_qat_start_trains_the_first_steps_in_float(tmp_path):
    """training.qat_start 0.5 of 4 steps: steps 1-2 are the plain run's, loss for loss; from step 3
    the forward sees the rounding; without training.qat the key is refused in one line."""
    def losses(run):
        return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]

    _train(tmp_path / "plain", "off", "lora", False, 64, steps=4)
    late = _train(tmp_path / "late", "q4_0", "lora", False, 64, steps=4, qat_start=0.5)
    plain, rounded = losses(tmp_path / "plain" / "run"), losses(tmp_path / "late" / "run")
    assert rounded[:2] == plain[:2] and rounded[2] != plain[2] and rounded[3] != plain[3]
    assert all(r.active for r in late.qat.roundings)
    with pytest.raises(ConfigError) as err:
        Config.from_dict(tiny_config(tmp_path / "m", tmp_path / "d.jsonl", tmp_path / "r", training={"qat_start": 0.5}))
    assert err.value.one_line() == ("config: training.qat_start 0.5 has no rounding to start: training.qat is off "
                                    "(hint: set training.qat (e.g. q4_0) or remove training.qat_start)")


def _training(**training):
    return Config.from_dict({"model": "m", "dataset": {"path": "d.jsonl"}, "training": {"qat": "q4_0", **training}}).training


def test_qat_fraction_rounds_exactly_that_share_of_the_matrices_each_step():
    """training.qat_fraction p (qat_noise matrices): every step from training.qat_start on rounds
    exactly round(p x N) of the N matrices, a new seeded draw each step, the same for the same seed
    and step; p 1 rounds all of them."""
    half = _training(qat_fraction=0.5)
    masks = [half.qat_matrices(step, 211) for step in range(1, 21)]
    assert [sum(m) for m in masks] == [106] * 20 and len({tuple(m) for m in masks}) == 20
    assert masks[0] == half.qat_matrices(1, 211) and masks[0] != _training(qat_fraction=0.5, seed=1).qat_matrices(1, 211)
    assert [i for i, m in enumerate(half.qat_matrices(3, 8)) if m] == [3, 4, 5, 7]
    assert sum(_training(qat_fraction=0.25).qat_matrices(1, 211)) == 53
    assert _training(qat_fraction=0.01).qat_matrices(1, 7).count(True) == 1  # at least one rounds
    assert _training().qat_matrices(1, 211) == [True] * 211
    assert sorted(half.qat_steps(20)) == list(range(1, 21))
    assert sorted(_training(qat_fraction=0.5, qat_start=0.5).qat_steps(20)) == list(range(11, 21))


def test_qat_fraction_of_the_steps_rounds_exactly_that_share_drawn_with_the_seed():
    """training.qat_fraction p, qat_noise steps: exactly round(p x steps) steps from training.qat_start
    on see the rounding, the same set for the same seed; 1 (the default) is every step."""
    def steps(total, **training):
        return sorted(_training(qat_noise="steps", **training).qat_steps(total))

    assert steps(20, qat_fraction=0.5) == [1, 3, 4, 10, 11, 12, 15, 17, 18, 19]
    assert steps(20, qat_fraction=0.5, seed=1) != steps(20, qat_fraction=0.5)
    assert [len(steps(20, qat_fraction=0.5, seed=s)) for s in range(5)] == [10] * 5
    assert len(steps(7, qat_fraction=0.3)) == 2 and len(steps(100, qat_fraction=0.05)) == 5
    assert steps(3, qat_fraction=0.01) == [1]  # at least one step rounds
    late = steps(20, qat_fraction=0.5, qat_start=0.5)
    assert len(late) == 5 and min(late) >= 11
    assert steps(20) == list(range(1, 21)) and steps(20, qat_start=0.5) == list(range(11, 21))


def test_qat_fraction_trains_the_drawn_steps_rounded_and_the_others_in_float(tmp_path):
    """Of 4 steps at qat_fraction 0.5 (qat_noise steps), seed 0 rounds steps 1 and 3: step 1 is the QAT run's loss for
    loss and step 2 is not; seed 2 rounds steps 2 and 3: step 1 is the plain run's and step 2 is not."""
    def losses(run):
        return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]

    for seed, rounded, twin in [(0, [1, 3], "q4_0"), (2, [2, 3], "off")]:
        noisy = _train(tmp_path / f"noisy{seed}", "q4_0", "lora", False, 64, steps=4, qat_fraction=0.5,
                       qat_noise="steps", seed=seed)
        assert sorted(noisy.qat_steps) == rounded
        _train(tmp_path / f"twin{seed}", twin, "lora", False, 64, steps=4, seed=seed)
        mixed, same = losses(tmp_path / f"noisy{seed}" / "run"), losses(tmp_path / f"twin{seed}" / "run")
        assert mixed[0] == same[0] and mixed[1] != same[1]
    shared = _train(tmp_path / "matrices", "q4_0", "lora", False, 64, steps=4, qat_fraction=0.5)
    flags = [r.active for r in shared.qat.roundings]  # as the last step left them
    assert len(flags) == 16 and flags == shared.cfg.training.qat_matrices(4, 16) and sum(flags) == 8
    with pytest.raises(ConfigError) as err:
        Config.from_dict(tiny_config(tmp_path / "m", tmp_path / "d.jsonl", tmp_path / "r", training={"qat_fraction": 0.5}))
    assert err.value.one_line() == ("config: training.qat_fraction 0.5 has no rounding to share out: training.qat is "
                                    "off (hint: set training.qat (e.g. q4_0) or remove training.qat_fraction)")
    for bad, why in [(0, "expected greater than 0"), (1.5, "expected less than or equal to 1")]:
        with pytest.raises(ConfigError) as err:
            Config.from_dict(tiny_config(tmp_path / "m", tmp_path / "d.jsonl", tmp_path / "r",
                                         training={"qat": "q4_0", "qat_fraction": bad}))
        assert err.value.one_line() == (f"config: invalid value for 'training.qat_fraction': {bad}: {why} (hint: see "
                                        "docs/config.md for allowed values)")


@pytest.mark.parametrize("method", ["lora", "full"])
def test_qat_float_weight_steps_on_the_weighted_sum_of_the_rounded_and_float_gradients(tmp_path, method, capsys):
    """training.qat_float_weight 0.25, one step of two micro-batches: every trained gradient is
    0.75 x the QAT run's (rounded weights) + 0.25 x the plain run's (float weights), the logged
    losses are those runs' and their weighted sum, and the header says it; the rounding is on again
    after the float pass. Without training.qat, or with optimizer_in_backward, one line refuses it."""
    def run(name, target, **training):
        grads = {}

        def keep(trainer, step):
            grads.update({n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad})

        trainer = _train(tmp_path / name, target, method, False, 64, steps=1, hooks={"after_backward": keep},
                         micro_batch_size=2, batch_size=4, **training)
        row = json.loads((tmp_path / name / "run" / "metrics.jsonl").read_text().splitlines()[0])
        return trainer, grads, row

    _, float_grads, plain = run("plain", "off")
    _, rounded_grads, qat = run("qat", "q4_0")
    mixed, mixed_grads, row = run("mixed", "q4_0", qat_float_weight=0.25)
    assert "each step's loss 0.75 x rounded + 0.25 x float weights, two passes per micro-batch " \
           "(training.qat_float_weight)" in capsys.readouterr().err
    assert sorted(mixed_grads) == sorted(float_grads) and len(mixed_grads) > 0
    differ = [n for n in mixed_grads if not torch.allclose(rounded_grads[n], float_grads[n], rtol=1e-3, atol=0)]
    assert len(differ) >= len(mixed_grads) // 2  # (LoRA's A gets no gradient while B is zero)
    for name, grad in mixed_grads.items():
        torch.testing.assert_close(grad, 0.75 * rounded_grads[name] + 0.25 * float_grads[name], rtol=1e-5, atol=1e-7)
    assert row["qat_rounded_loss"] == pytest.approx(qat["loss"], rel=1e-6)
    assert row["qat_float_loss"] == pytest.approx(plain["loss"], rel=1e-6)
    assert row["loss"] == pytest.approx(0.75 * qat["loss"] + 0.25 * plain["loss"], rel=1e-6)
    assert all(r.active for r in mixed.qat.roundings)
    for training, line in [({"qat_float_weight": 0.5}, "config: training.qat_float_weight 0.5 has no rounded loss to "
                            "mix with: training.qat is off (hint: set training.qat (e.g. q4_0) or remove "
                            "training.qat_float_weight)"),
                           ({"qat": "q4_0", "qat_float_weight": 0.5, "optimizer_in_backward": True},
                            "config: training.qat_float_weight 0.5 runs two backward passes per step, and "
                            "training.optimizer_in_backward steps the weights inside the first (hint: set "
                            "training.optimizer_in_backward: false or remove training.qat_float_weight)")]:
        with pytest.raises(ConfigError) as err:
            Config.from_dict(tiny_config(tmp_path / "m", tmp_path / "d.jsonl", tmp_path / "r", training=training))
        assert err.value.one_line() == line


def test_int4_run_refuses_a_gguf_export_naming_both(tmp_path, capsys):
    _train(tmp_path, "int4", "lora", False, 64, steps=1)
    assert main(["export", str(tmp_path / "run"), "--format", "gguf", "--out", str(tmp_path / "x.gguf")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'run'} was trained for int4 (training.qat), which --format gguf cannot hold (GGUF has no "
        "int4 type) (hint: pass --quant (e.g. --quant f16) to write it anyway, or --format merged)")


def test_qat_on_a_family_without_gguf_export_is_refused_before_training(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from maximus.train.trainer import Trainer

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=300)).save_pretrained(tmp_path / "gpt2")
    cfg = tiny_config(tmp_path / "gpt2", tmp_path / "d.jsonl", tmp_path / "run", training={"qat": "q4_0"})
    with pytest.raises(ConfigError) as err:
        Trainer(Config.from_dict(cfg)).setup()
    assert err.value.one_line() == (
        "training.qat: q4_0 trains for a GGUF export, and model type 'gpt2' has no GGUF export (hint: use "
        "training.qat: int4 or off for this model)")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("method,target", [("lora", "q4_0"), ("full", "int4")])
def test_planner_counts_the_rounded_copies_qat_keeps(tmp_path, method, target):
    """The estimate's weights grow by exactly the bytes the rounded weights hold after a training forward."""
    from maximus.memory.estimate import estimate_peak
    from maximus.models import load_model

    model_dir = build_tiny_model_dir(tmp_path / "model", "llama", hidden=64, tie=True)
    cfg = Config.from_dict(tiny_config(model_dir, tmp_path / "d.jsonl", tmp_path / "run", method=method))
    model, _ = load_model(cfg, device=torch.device("cpu"), method=method)
    install_qat(model, target)
    model.train()
    model(torch.tensor([[1, 2, 3]]))
    held = {id(m.__dict__["_qat_rounding"]): m.__dict__["_qat_rounding"].value for m in model.modules()
            if "_qat_rounding" in m.__dict__}
    held_bytes = sum(v.numel() * v.element_size() for v in held.values())
    kwargs = dict(method=method, dtype="fp32", seq_len=64, device="cpu")
    plain, rounded = estimate_peak(model_dir, **kwargs), estimate_peak(model_dir, qat=target, **kwargs)
    assert rounded.breakdown["weights"] - plain.breakdown["weights"] == held_bytes > 0


def test_planner_counts_the_float_pass_as_a_second_backward(tmp_path):
    """training.qat_float_weight: the memory is that of two micro-steps (gradients alive through the
    second pass; full fine-tuning's forward then holds them all), the compute twice; the config's
    value reaches the run's spec."""
    from maximus.memory.estimate import estimate_peak
    from maximus.memory.spec_from_config import run_spec

    model_dir = build_tiny_model_dir(tmp_path / "model", "llama", hidden=64)
    kwargs = dict(method="full", dtype="fp32", seq_len=64, device="cpu", qat="q4_0")
    one, mixed = estimate_peak(model_dir, **kwargs), estimate_peak(model_dir, qat_float_weight=0.5, **kwargs)
    accumulating = estimate_peak(model_dir, grad_accum=2, **kwargs)
    assert mixed.breakdown == accumulating.breakdown and mixed.peak_bytes > one.peak_bytes
    plain = estimate_peak(model_dir, **{**kwargs, "qat": "off"})
    rounding = 1 / one.compute_tokens_per_s - 1 / plain.compute_tokens_per_s  # once a step, not a pass
    assert rounding > 0
    assert 1.9 < (1 / mixed.compute_tokens_per_s - rounding) * plain.compute_tokens_per_s <= 2.0
    cfg = Config.from_dict(tiny_config(model_dir, tmp_path / "d.jsonl", tmp_path / "run", method="full",
                                       training={"qat": "q4_0", "qat_float_weight": 0.5}))
    tech = run_spec(cfg, device="cpu").techniques
    assert tech.qat_float_weight == 0.5 and tech.passes == 2


def test_planner_counts_the_rounding_once_per_optimizer_step(tmp_path):
    """The step-time guess adds llama.cpp's rounding of what each optimizer step changed: every
    matrix with full fine-tuning (the decoder's linears only under int4), the adapted ones with LoRA;
    K-quant search where the columns divide into 256 (q4_k_m), blocks of 32 elsewhere; spread over
    the micro-steps of a step."""
    from maximus.memory.estimate import estimate_peak
    from maximus.memory.step_time import CALIBRATION

    model_dir = build_tiny_model_dir(tmp_path / "model", "llama", hidden=256)
    rates = CALIBRATION[("cpu", "fp32")].qat_round_s_per_weight
    cfg = json.loads((model_dir / "config.json").read_text())
    h, i, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    layers = cfg["num_hidden_layers"]
    # columns h = 256 and i divide into 256: every matrix takes the K-quant search; embedding and head apart
    assert h % 256 == 0 and i % 256 == 0 and cfg.get("tie_word_embeddings", False) is False
    linear = h * h * 2 + h * kv * 2 + 3 * h * i
    full_weights = layers * linear + 2 * vocab * h

    def seconds(grad_accum=1, **kw):
        est = estimate_peak(model_dir, dtype="fp32", seq_len=64, device="cpu", grad_accum=grad_accum, **kw)
        return 64 / est.compute_tokens_per_s

    for method, weights in (("full", full_weights), ("lora", layers * linear)):
        plain = seconds(method=method)
        assert seconds(method=method, qat="q4_k_m") - plain == pytest.approx(weights * rates["kquant"], rel=1e-6)
        assert seconds(method=method, qat="q4_0") - plain == pytest.approx(weights * rates["legacy"], rel=1e-6)
        # int4 rounds the decoder's linears only, never the embedding or the head
        assert seconds(method=method, qat="int4") - plain == pytest.approx(layers * linear * rates["legacy"], rel=1e-6)
        accumulating = seconds(method=method, grad_accum=2)
        assert seconds(method=method, grad_accum=2, qat="q4_0") - accumulating == pytest.approx(
            weights * rates["legacy"] / 2, rel=1e-6)
