"""The family matrix: a tiny random model of each tested Transformers class (maximus.families),
each cell checked against its oracle (docs/models.md names the test of every cell).

- the exact chunked loss and its gradients equal Transformers' own loss (fp32), with Gemma's final
  soft-cap, Granite's logit scaling and the mixture-of-experts router loss;
- LoRA trains (trainer, 2 steps), the adapter loads in PEFT with identical logits, the lean norm
  and lean LoRA apply or say why not; QLoRA runs a step on the 4-bit base;
- mixture of experts: the adapter reaches every expert (r x shapes x experts), the router stays
  frozen, the router loss is logged; `lora.experts` switches the experts off, and is refused on a
  dense model.
"""
from __future__ import annotations

import json

import pytest
import torch

from tiny import (FAMILY_FIELDS, build_family_model_dir, long_run_config, measured_run, one_thread,  # noqa: F401
                  tiny_config, write_long_documents, write_prompt_completion)

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = list(FAMILY_FIELDS)
MOE = ["qwen3_moe", "mixtral", "gpt_oss"]
#: Norm classes the lean norm leaves to Transformers (a different rounding order), by family.
NORM_KEPT = {"olmo2": "Olmo2RMSNorm", "gpt_oss": "GptOssRMSNorm"}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {t: build_family_model_dir(root / t, t) for t in FAMILIES}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_prompt_completion(tmp_path_factory.mktemp("family-data") / "data.jsonl", n=24)


def _cfg(model_dir, method="lora", **lora):
    from maximus.config import Config

    return Config.from_dict({"model": str(model_dir), "dataset": "unused.jsonl", "method": method, "device": "cpu",
                             "lora": {"r": 4, "alpha": 8, **lora}, "training": {"dtype": "fp32", "seq_len": 64}})


def _batch(vocab: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (2, 24), generator=g)
    labels = ids.clone()
    labels[:, :6] = -100  # a prompt
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_exact_loss_and_gradients_equal_transformers(family_dirs, model_type):
    from transformers import AutoConfig, AutoModelForCausalLM

    from maximus.families import attention_implementation
    from maximus.forward import sft_loss_sum

    config = AutoConfig.from_pretrained(family_dirs[model_type])
    config.output_router_logits = model_type in MOE  # the router loss counts in Transformers' loss too
    model = AutoModelForCausalLM.from_pretrained(family_dirs[model_type], config=config, dtype=torch.float32,
                                                 attn_implementation=attention_implementation(config)[0])
    batch = _batch(config.vocab_size)
    theirs = model(**batch)
    their_grads = torch.autograd.grad(theirs.loss, list(model.parameters()), allow_unused=True)
    metrics: dict = {}
    loss_sum, count = sft_loss_sum(model, batch, metrics=metrics)
    ours = loss_sum / count
    our_grads = torch.autograd.grad(ours, list(model.parameters()), allow_unused=True)
    torch.testing.assert_close(ours, theirs.loss, rtol=0, atol=1e-5)
    for a, b in zip(our_grads, their_grads):
        if a is not None or b is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    if model_type in MOE:
        assert metrics["router_aux_loss"] / int(count) == pytest.approx(float(theirs.aux_loss), rel=1e-6)
    if model_type == "granite":  # the scaling is really exercised
        assert config.logits_scaling == 4.0
    if model_type.startswith("gemma"):
        assert config.final_logit_softcapping == 30.0


@pytest.fixture(scope="module")
def lora_runs(family_dirs, data, tmp_path_factory):
    """One 2-step LoRA run per family, trained on first use: {model_type: (trainer, run_dir)}."""
    from maximus.config import Config
    from maximus.train.trainer import Trainer

    runs = {}

    def run(model_type):
        if model_type not in runs:
            out = tmp_path_factory.mktemp(f"run-{model_type}") / "run"
            cfg = tiny_config(family_dirs[model_type], data, out, lora={"r": 4, "alpha": 8},
                              training={"max_steps": 2, "batch_size": 4, "micro_batch_size": 4},
                              eval={"split": 0.0, "before": False})
            trainer = Trainer(Config.from_dict(cfg))
            trainer.train()
            runs[model_type] = (trainer, out)
        return runs[model_type]

    return run


@pytest.mark.parametrize("model_type", FAMILIES)
def test_lora_trains_and_the_adapter_loads_in_peft(family_dirs, lora_runs, model_type):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from maximus.families import attention_implementation

    trainer, out = lora_runs(model_type)
    summary = json.loads((out / "run.json").read_text())
    assert summary["steps"] == 2 and summary["skipped_steps"] == 0
    base = AutoModelForCausalLM.from_pretrained(family_dirs[model_type], dtype=torch.float32,
                                                attn_implementation=attention_implementation(trainer.model.config)[0])
    theirs = PeftModel.from_pretrained(base, str(out / "adapter")).eval()
    ours = trainer.model.eval()
    ids = _batch(base.config.vocab_size, seed=1)["input_ids"]
    with torch.no_grad():
        expected = theirs(ids).logits
        got = ours(ids).logits
        with theirs.disable_adapter():
            untrained = theirs(ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert (expected - untrained).abs().max() > 1e-3  # the adapter was trained and is applied


@pytest.mark.parametrize("model_type", FAMILIES)
def test_lean_norm_and_lean_lora_apply_or_say_why(lora_runs, model_type):
    trainer, out = lora_runs(model_type)
    kernels = json.loads((out / "run.json").read_text())["kernels"]
    assert kernels["lean_lora"] > 0
    if model_type in NORM_KEPT:
        assert kernels["lean_norm"] == 0
        assert (f"notice: lean norm: {NORM_KEPT[model_type]} computes its norm in another order than the Llama and "
                "Gemma norms; Transformers' norm is kept") in kernels["notices"]
    else:
        assert kernels["lean_norm"] > 0
    if model_type in MOE:  # on CPU the experts and their adapters run the grouped expert forward
        assert kernels["grouped_experts"] == 2
        assert not any(n.startswith("notice: lean LoRA") for n in kernels["notices"])


@pytest.mark.parametrize("model_type", FAMILIES)
def test_qlora_step_on_the_4bit_base(family_dirs, model_type):
    from maximus import load_model
    from maximus.forward import sft_loss_sum

    model, _ = load_model(_cfg(family_dirs[model_type], method="qlora"))
    assert any(type(m).__name__ == "Linear4bit" for m in model.modules())
    loss_sum, count = sft_loss_sum(model, _batch(model.config.vocab_size))
    (loss_sum / count).backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(float(g.abs().max()) > 0 for g in grads)


@pytest.mark.parametrize("model_type", MOE)
def test_moe_adapter_holds_every_expert_and_not_the_router(lora_runs, model_type):
    from safetensors import safe_open

    trainer, out = lora_runs(model_type)
    with safe_open(str(out / "adapter" / "adapter_model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert not [k for k in shapes if "router" in k or ".gate." in k]
    base = trainer.model.get_base_model()
    r, expected = 4, 0
    for name, p in base.named_parameters():
        if p.dim() == 3 and ".experts." in name and "lora" not in name:
            experts, a, b = p.shape  # [experts, *] with in + out = a + b whichever way round
            expected += r * experts * (a + b)
    got = sum(torch.Size(s).numel() for k, s in shapes.items() if ".experts." in k)
    assert expected > 0 and got == expected
    assert all(not p.requires_grad for n, p in trainer.model.named_parameters() if "router" in n or ".gate." in n)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("router_aux_loss" in m for m in metrics)


def test_lora_experts_false_leaves_the_experts_and_true_is_refused_on_dense(family_dirs):
    from maximus import load_model
    from maximus.errors import ConfigError

    model, _ = load_model(_cfg(family_dirs["mixtral"], experts=False))
    assert not any(type(m).__name__ == "ParamWrapper" for m in model.modules())
    assert any(n.endswith("q_proj.lora_A.default.weight") for n, _ in model.named_parameters())
    with pytest.raises(ConfigError) as err:
        load_model(_cfg(family_dirs["llama"], experts=True))
    assert str(err.value) == ("lora.experts: true, but LlamaForCausalLM is not a mixture of experts "
                              "(hint: drop lora.experts (it applies to mixture-of-experts models only))")


@pytest.mark.parametrize("norm_class", ["Qwen3RMSNorm", "Qwen3MoeRMSNorm", "MixtralRMSNorm", "Phi3RMSNorm",
                                        "GraniteRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm"])
def test_lean_norm_classes_compute_transformers_norm_exactly(norm_class):
    import transformers

    from maximus.kernels.lean_norm import lean_rms_norm, norm_settings

    module = getattr(transformers, norm_class.removesuffix("RMSNorm") + "PreTrainedModel").__module__
    import importlib

    norm = getattr(importlib.import_module(module), norm_class)(32)
    with torch.no_grad():
        norm.weight.normal_()
    eps, offset = norm_settings(norm)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(8, 32, dtype=dtype)
        expected = norm(x)
        got = lean_rms_norm(x, norm.weight, eps, offset=offset)
        assert got.dtype == expected.dtype
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_plan_predicts_the_measured_peak_within_10_percent(lora_runs, model_type):
    """The planner's peak (run.json plan.peak_bytes) against the meter's (memory.peak_bytes) on the
    same 2-step LoRA run: experts, routing, eager attention and Gemma's norms are modelled."""
    _, out = lora_runs(model_type)
    summary = json.loads((out / "run.json").read_text())
    error = summary["plan"]["peak_bytes"] / summary["memory"]["peak_bytes"] - 1
    assert -0.10 <= error <= 0.10, f"{model_type}: predicted {error:+.1%} of the measured peak"


#: Long sequences, where the heads x tokens x tokens terms dominate: every family once, both lengths
#: and both modes across the matrix (checkpointing, the direction that under-predicts, most), the
#: attention-heavy classes in both modes. The whole grid (every family x 1,024 / 2,048 x off / full)
#: is `benchmarks/plan_families.py`, its table in docs/models.md.
LONG_RUNS = [("llama", 1024, "full"), ("mistral", 2048, "off"), ("qwen2", 2048, "full"), ("qwen3", 1024, "full"),
             ("olmo2", 2048, "full"), ("gemma2", 1024, "off"), ("gemma2", 1024, "full"),
             ("gemma3_text", 1024, "off"), ("gemma3_text", 2048, "full"), ("phi3", 2048, "full"),
             ("granite", 2048, "full"), ("qwen3_moe", 1024, "off"), ("mixtral", 2048, "full"),
             ("gpt_oss", 1024, "full"), ("gpt_oss", 2048, "off")]


@pytest.mark.parametrize("model_type, seq_len, checkpointing", LONG_RUNS)
def test_the_plan_predicts_the_measured_peak_at_long_sequences(tmp_path_factory, model_type, seq_len, checkpointing):
    """The same comparison on 2 LoRA steps of one seq_len-token row (a document cut to length), with
    and without full checkpointing: the attention masks and tensors, q / k norms and the fused
    projections are modelled at length, not only at 64 tokens."""
    from maximus import Config

    root = tmp_path_factory.getbasetemp() / "long-families"
    model_dir = root / model_type
    if not model_dir.exists():
        build_family_model_dir(model_dir, model_type, max_position_embeddings=2048)
    data = root / f"text-{seq_len}.jsonl"
    if not data.exists():
        write_long_documents(data, seq_len)
    out = tmp_path_factory.mktemp(f"long-{model_type}") / "run"
    predicted, measured, _ = measured_run(Config.from_dict(long_run_config(model_dir, data, out, seq_len, checkpointing)))
    error = predicted / measured - 1
    assert -0.10 <= error <= 0.10, f"{model_type}, {seq_len} tokens, {checkpointing}: predicted {error:+.1%}"
