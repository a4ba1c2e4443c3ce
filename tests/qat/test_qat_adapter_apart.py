"""`training.qat_adapter: separate` and `maximus export --format gguf-lora`: the adapter trains in
float beside the base rounded as the base file holds it, and the export writes exactly that pair,
the base GGUF and a llama.cpp LoRA file, which llama.cpp applies as PEFT does (its scores equal the
Transformers model's); the warnings when a format holds the adapter otherwise, and the refusals."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from maximus.cli import main
from maximus.config import Config
from maximus.errors import ConfigError
from maximus.qat.install import fake_quantized_weight, gguf_rounding, install_qat
from tiny import (LLAMA_CPP_MARKS, build_tiny_model_dir, llama_cpp_or_skip, one_thread,  # noqa: F401  (one_thread: a fixture)
                  tiny_config, write_prompt_completion)

llama_cpp_or_skip()  # the export's K-quants and the scoring run in llama.cpp

pytestmark = LLAMA_CPP_MARKS


def _train(root, target="q4_0", method="lora", steps=2, **training):
    from maximus.train.trainer import Trainer

    model_dir = build_tiny_model_dir(root / "model", "llama", hidden=64)
    data = write_prompt_completion(root / "data.jsonl")
    qat = {"qat": target, **({"qat_adapter": "separate"} if target != "off" and method != "full" else {})}
    cfg = tiny_config(model_dir, data, root / "run", method=method, eval={"split": 0.1, "before": False},
                      training={"max_steps": steps, **qat, **training})
    trainer = Trainer(Config.from_dict(cfg))
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def apart_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("apart")
    trainer = _train(root)
    return trainer, root


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_separate_lora_forward_is_the_rounded_base_plus_the_float_adapter(tmp_path, method):
    """In training mode a layer computes x Q(W)^T + s (x A^T) B^T, and the adapter's gradient is that
    expression's exact gradient (no straight-through step: nothing rounds what it trains)."""
    from maximus.models import load_model

    model_dir = build_tiny_model_dir(tmp_path / "model", "llama", hidden=64)
    cfg = Config.from_dict(tiny_config(model_dir, tmp_path / "d.jsonl", tmp_path / "run", method=method))
    model, _ = load_model(cfg, device=torch.device("cpu"), method=method)
    layer = model.get_base_model().model.layers[0].self_attn.q_proj
    torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.5)
    base = layer.get_base_layer().weight
    if hasattr(base, "quant_state"):
        import bitsandbytes.functional as bnb_f

        base = bnb_f.dequantize_4bit(base.data, base.quant_state)
    rounded = gguf_rounding("q4_0", fp16_first=False)(base.detach().float())
    install_qat(model, "q4_0", adapter="separate")
    assert torch.equal(fake_quantized_weight(layer), rounded)
    a, b, s = layer.lora_A["default"].weight, layer.lora_B["default"].weight, layer.scaling["default"]
    x = torch.randn(3, 64)
    model.train()
    out = layer(x)
    expected = x @ rounded.T + s * (x @ a.T) @ b.T
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    grad_b, = torch.autograd.grad((out ** 2).sum(), b)
    twin_b = b.detach().clone().requires_grad_(True)
    twin_grad, = torch.autograd.grad(((x @ rounded.T + s * (x @ a.T) @ twin_b.T) ** 2).sum(), twin_b)
    torch.testing.assert_close(grad_b, twin_grad, rtol=1e-5, atol=1e-5)
    merged = fake_quantized_weight(layer) + s * b @ a  # not the merged rounding Q(W + s B A)
    assert not torch.equal(gguf_rounding("q4_0", fp16_first=False)(base.detach().float() + s * (b @ a).detach()),
                           merged.detach())


def test_gguf_lora_export_holds_the_trained_base_and_adapter_exactly(apart_run, tmp_path, capsys):
    """The base file's tensors are the rounded base the run trained against, bit for bit; the LoRA
    file's are A and s B (Q and K rows in llama.cpp's RoPE order); --quant defaults to the target."""
    import gguf

    from maximus.export.gguf_arch import permute_for_llama_rope

    trainer, _ = apart_run
    out = tmp_path / "apart"
    assert main(["export", str(trainer.run_dir), "--format", "gguf-lora", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "warning" not in said
    assert said.splitlines()[-1] == f"wrote {out} (run with: llama-cli -m {out / 'model.gguf'} --lora {out / 'adapter.gguf'})"
    base_file, lora_file = gguf.GGUFReader(str(out / "model.gguf")), gguf.GGUFReader(str(out / "adapter.gguf"))
    assert json.loads(bytes(base_file.fields["maximus.export"].parts[-1]).decode())["quant"] == "q4_0"
    assert bytes(lora_file.fields["general.type"].parts[-1]).decode() == "adapter"
    in_base = {t.name: np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32) for t in base_file.tensors}
    in_lora = {t.name: np.asarray(t.data, np.float32) for t in lora_file.tensors}
    lm = trainer.model.get_base_model()
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, lm.config.num_hidden_layers)
    heads = {"q_proj": lm.config.num_attention_heads, "k_proj": lm.config.num_key_value_heads}
    compared = 0
    for path, module in lm.named_modules():
        if not hasattr(module, "lora_A"):
            continue
        name = names.get_name(path + ".weight", try_suffixes=(".weight",))
        leaf = path.rsplit(".", 1)[-1]
        order = (lambda w: permute_for_llama_rope(w, heads[leaf])) if leaf in heads else (lambda w: w)
        rounded = order(fake_quantized_weight(module))
        assert np.array_equal(rounded.numpy(), in_base[name].reshape(rounded.shape)), name
        a = module.lora_A["default"].weight.detach()
        b = order(module.lora_B["default"].weight.detach() * module.scaling["default"])
        assert np.array_equal(a.numpy(), in_lora[name + ".lora_a"].reshape(a.shape)), name
        assert np.array_equal(b.numpy(), in_lora[name + ".lora_b"].reshape(b.shape)), name
        compared += 1
    assert compared == 2 * 7 and len(in_lora) == 2 * compared


def test_llama_cpp_applies_the_lora_file_as_peft_does(apart_run, tmp_path, capsys):
    """An f32 gguf-lora export scored in llama.cpp (base + LoRA file) equals the Transformers model
    (base + PEFT adapter) on the held-out rows; `eval` finds it under RUN/exports/ and labels it."""
    trainer, _ = apart_run
    run = trainer.run_dir
    out = run / "exports" / "apart-f32"
    assert main(["export", str(run), "--format", "gguf-lora", "--quant", "f32", "--out", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        f"warning: {run} was trained for q4_0 (training.qat); --quant f32 rounds its weights differently than it "
        "trained for (omit --quant to write q4_0)")
    from maximus.evaluate.deployed import deployed_files

    assert deployed_files(run) == [out]
    assert main(["eval", str(run), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    deployed, = result["deployed"]
    assert deployed["adapter"] == str(out / "adapter.gguf") and deployed["tokens"] == result["after"]["tokens"] > 0
    assert deployed["loss"] == pytest.approx(result["after"]["loss"], rel=1e-4)
    assert main(["eval", str(run), "--gguf", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[0].split() == ["base", "(before)", "tuned", "(after)", "deployed",
                                                              "f32", "+", "lora"]
    assert main(["eval", str(run), "--gguf", str(run)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: --gguf {run}: a directory without model.gguf and adapter.gguf (hint: pass a .gguf file or a "
        "--format gguf-lora directory written by maximus export)")


def test_each_format_warns_when_it_holds_the_adapter_otherwise_than_training(apart_run, tmp_path, capsys):
    trainer, root = apart_run
    run = trainer.run_dir
    assert main(["export", str(run), "--format", "gguf", "--out", str(tmp_path / "merged.gguf")]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        f"warning: {run} trained its adapter beside the rounded base (training.qat_adapter: separate); --format gguf "
        "merges it and rounds the sum, unlike training (use --format gguf-lora)")
    merged = _train(tmp_path / "m", qat_adapter="merged", steps=1).run_dir
    capsys.readouterr()
    assert main(["export", str(merged), "--format", "gguf-lora", "--out", str(tmp_path / "apart")]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        f"warning: {merged} trained against the rounded merged weights (training.qat_adapter: merged); --format "
        "gguf-lora keeps the adapter apart, unlike training (use --format gguf)")


def test_gguf_lora_refuses_a_full_fine_tuning_run(tmp_path, capsys):
    run = _train(tmp_path, target="off", method="full", steps=1).run_dir
    capsys.readouterr()
    assert main(["export", str(run), "--format", "gguf-lora", "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: {run} is a full fine-tuning run: it has no adapter to keep apart (hint: use --format gguf)")
    assert not (tmp_path / "x").exists()


def test_qat_adapter_separate_is_refused_where_it_cannot_apply(tmp_path):
    from maximus.qat.check import check_qat

    def config(method="lora", **training):
        return Config.from_dict(tiny_config(tmp_path / "m", tmp_path / "d.jsonl", tmp_path / "r", method=method,
                                            training=training))

    for training, line in [
        ({"qat_adapter": "separate"}, "config: training.qat_adapter separate keeps the adapter beside a GGUF base "
         "file, and training.qat is off (hint: set training.qat to a GGUF target (q8_0, q4_0, q4_k_m) or remove "
         "training.qat_adapter)"),
        ({"qat": "int4", "qat_adapter": "separate"}, "config: training.qat_adapter separate keeps the adapter beside a "
         "GGUF base file, and training.qat is int4 (hint: set training.qat to a GGUF target (q8_0, q4_0, q4_k_m) or "
         "remove training.qat_adapter)")]:
        with pytest.raises(ConfigError) as err:
            config(**training)
        assert err.value.one_line() == line
    model_config = __import__("transformers").LlamaConfig()
    with pytest.raises(ConfigError) as err:
        check_qat(config("full", qat="q4_0", qat_adapter="separate"), model_config)
    assert err.value.one_line() == ("training.qat_adapter: separate keeps a LoRA adapter beside the base file, and "
                                    "method full trains no adapter (hint: use method lora or qlora, or remove "
                                    "training.qat_adapter)")
    cfg = Config.from_dict(tiny_config(tmp_path / "m", tmp_path / "d.jsonl", tmp_path / "r", lora={"modules_to_save": ["lm_head"]},
                                       training={"qat": "q4_0", "qat_adapter": "separate"}))
    with pytest.raises(ConfigError) as err:
        check_qat(cfg, model_config)
    assert err.value.one_line() == ("training.qat_adapter: separate writes the adapter as a llama.cpp LoRA file, which "
                                    "holds no fully trained modules (lora.modules_to_save: ['lm_head']) (hint: remove "
                                    "lora.modules_to_save or use training.qat_adapter: merged)")


def test_planner_counts_no_rounding_per_step_and_the_same_cache(tmp_path):
    """Under qat_adapter separate a LoRA step's time holds no rounding (the frozen base is rounded
    once, the adapter never), and the cache of rounded copies is the merged mode's; the config's
    key reaches the planner's spec."""
    from maximus.memory.estimate import estimate_peak
    from maximus.memory.spec_from_config import run_spec

    model_dir = build_tiny_model_dir(tmp_path / "model", "llama", hidden=64)

    def estimate(**kw):
        return estimate_peak(model_dir, method="lora", dtype="fp32", seq_len=64, device="cpu", **kw)

    plain, merged, apart = estimate(), estimate(qat="q4_0"), estimate(qat="q4_0", qat_adapter="separate")
    assert apart.compute_tokens_per_s == plain.compute_tokens_per_s > merged.compute_tokens_per_s
    assert apart.peak_bytes == merged.peak_bytes > plain.peak_bytes
    cfg = Config.from_dict(tiny_config(model_dir, tmp_path / "d.jsonl", tmp_path / "r",
                                       training={"qat": "q4_0", "qat_adapter": "separate"}))
    assert run_spec(cfg, device="cpu").techniques.qat_adapter == "separate"
