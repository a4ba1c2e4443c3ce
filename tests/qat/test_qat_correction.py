"""`training.qat_correction_rank`: a frozen low-rank correction of the base's rounding, served beside
the adapter. The factors reach the Eckart-Young bound in the inputs' metric; training reads each
adapted base as Q(W) + L R; the run keeps the factors in adapter/ (its float model without them);
`--format gguf-lora` writes [A; R] and [s B, L] beside the rounded base, bit for bit, and llama.cpp
serves the pair as Transformers computes it; and the key is refused where it cannot apply."""
from __future__ import annotations


import numpy as np
import pytest
import torch

from maximus.cli import main
from maximus.config import Config
from maximus.errors import ConfigError
from maximus.qat.correction import (CALIBRATION_ROWS, CORRECTION_FILE, correction_factors, input_covariances,
                                    load_corrections)
from maximus.qat.install import apply_corrections, fake_quantized_weight, gguf_rounding, install_qat
from maximus.qat.targets import rounds_to_fp16_first
from tiny import (LLAMA_CPP_MARKS, build_tiny_model_dir, llama_cpp_or_skip, one_thread,  # noqa: F401  (one_thread: a fixture)
                  tiny_config, write_prompt_completion)

llama_cpp_or_skip()  # the export's scoring runs in llama.cpp

pytestmark = LLAMA_CPP_MARKS

RANK = 4


@pytest.mark.parametrize("rank", [1, 3, 7])
def test_the_factors_reach_the_eckart_young_bound_in_the_inputs_metric(rank):
    """|| (E - L R) X^T ||_F^2 equals the sum of the squared singular values of E X^T past `rank`
    (the best any rank-`rank` matrix can do), and L R has rank `rank`."""
    g = torch.Generator().manual_seed(rank)
    error = torch.randn(12, 9, generator=g, dtype=torch.float64)
    inputs = torch.randn(40, 9, generator=g, dtype=torch.float64) * torch.linspace(0.1, 3.0, 9, dtype=torch.float64)
    left, right = correction_factors(error, inputs.T @ inputs, rank)
    assert left.shape == (12, rank) and right.shape == (rank, 9)
    residual = ((error - left @ right) @ inputs.T).square().sum()
    bound = torch.linalg.svdvals(error @ inputs.T)[rank:].square().sum()
    assert float(residual) == pytest.approx(float(bound), rel=1e-5)
    assert int(torch.linalg.matrix_rank(left @ right)) == rank


def _train(root, steps=2, **training):
    from maximus.train.trainer import Trainer

    model_dir = build_tiny_model_dir(root / "model", "llama", hidden=64)
    data = write_prompt_completion(root / "data.jsonl")
    cfg = tiny_config(model_dir, data, root / "run", method="lora", eval={"split": 0.1, "before": False},
                      training={"max_steps": steps, "qat": "q4_0", "qat_adapter": "separate",
                                "qat_correction_rank": RANK, **training})
    trainer = Trainer(Config.from_dict(cfg))
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def corrected_run(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("corrected"))


@pytest.fixture(scope="module")
def calibration(corrected_run):
    """({path: LoRA layer}, {path: X^T X of its base's inputs over the first CALIBRATION_ROWS
    training rows, adapters off}), measured again on the trained run."""
    model = corrected_run.model
    layers = {p: m for p, m in model.get_base_model().named_modules() if hasattr(m, "lora_A")}
    rows = corrected_run.data.train[:CALIBRATION_ROWS]
    model.eval()
    with model.disable_adapter():
        cov = input_covariances(model, {p: m.get_base_layer() for p, m in layers.items()}, rows, torch.device("cpu"))
    model.train()
    return layers, cov


def test_training_reads_the_rounded_base_plus_the_correction_of_the_first_rows(corrected_run, calibration):
    """Each adapted base reads as Q(W) + L R, with (L, R) the correction of W - Q(W) in the metric of
    the base's own inputs (adapters off) over the first CALIBRATION_ROWS training rows; the run keeps
    the factors in adapter/, and its float model (the PEFT adapter) does not hold them."""
    trainer = corrected_run
    layers, cov = calibration
    saved, meta = load_corrections(trainer.run_dir / "adapter")
    assert meta == {"target": "q4_0", "rank": RANK}
    assert sorted(saved) == sorted(layers) and len(layers) == 2 * 7
    for path, layer in layers.items():
        weight = layer.get_base_layer()._parameters["weight"].detach().float()
        rounded = gguf_rounding(trainer.qat.types[path], rounds_to_fp16_first("q4_0"))(weight)
        left, right = correction_factors(weight - rounded, cov[path], RANK)
        torch.testing.assert_close(saved[path][0] @ saved[path][1], (left @ right).float(), rtol=1e-4, atol=1e-6)
        assert torch.equal(fake_quantized_weight(layer), rounded + saved[path][0] @ saved[path][1]), path
    import safetensors.torch

    adapter = safetensors.torch.load_file(str(trainer.run_dir / "adapter" / "adapter_model.safetensors"))
    assert {t.shape[0] for k, t in adapter.items() if "lora_A" in k} == {trainer.cfg.lora.r}
    assert (trainer.run_dir / "adapter" / CORRECTION_FILE).is_file()


def test_the_correction_moves_the_served_model_toward_the_float_one(corrected_run, calibration):
    """On the calibration rows, each adapted layer's output with Q(W) + L R is closer to the float
    base's than with Q(W) alone, in every layer (what the correction is for)."""
    trainer = corrected_run
    layers, cov = calibration
    saved, _ = load_corrections(trainer.run_dir / "adapter")
    for path, layer in layers.items():
        weight = layer.get_base_layer()._parameters["weight"].detach().float()
        error = weight - gguf_rounding(trainer.qat.types[path], rounds_to_fp16_first("q4_0"))(weight)

        def size(e):
            return float(torch.trace(e.double() @ cov[path].double() @ e.double().T))
        assert size(error - saved[path][0] @ saved[path][1]) < 0.9 * size(error), path


def test_gguf_lora_writes_the_correction_beside_the_adapter_exactly(corrected_run, tmp_path, capsys):
    """adapter.gguf holds [A; R] and [s B, L] (rank r + N, Q and K rows in llama.cpp's order) and
    model.gguf the rounded base Q(W), bit for bit; the export says it holds the correction."""
    import gguf

    from maximus.export.gguf_arch import permute_for_llama_rope

    trainer = corrected_run
    run = trainer.run_dir
    out = tmp_path / "apart"
    assert main(["export", str(run), "--format", "gguf-lora", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "warning" not in said
    assert said.splitlines()[0] == (f"notice: adapter.gguf holds the run's rank-{RANK} correction of the base's q4_0 "
                                    "rounding beside the adapter (training.qat_correction_rank)")
    saved, _ = load_corrections(run / "adapter")
    base_file, lora_file = gguf.GGUFReader(str(out / "model.gguf")), gguf.GGUFReader(str(out / "adapter.gguf"))
    in_base = {t.name: np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32) for t in base_file.tensors}
    in_lora = {t.name: np.asarray(t.data, np.float32) for t in lora_file.tensors}
    lm = trainer.model.get_base_model()
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, lm.config.num_hidden_layers)
    heads = {"q_proj": lm.config.num_attention_heads, "k_proj": lm.config.num_key_value_heads}
    for path, module in lm.named_modules():
        if not hasattr(module, "lora_A"):
            continue
        name = names.get_name(path + ".weight", try_suffixes=(".weight",))
        leaf = path.rsplit(".", 1)[-1]
        order = (lambda w: permute_for_llama_rope(w, heads[leaf])) if leaf in heads else (lambda w: w)
        weight = module.get_base_layer()._parameters["weight"].detach().float()
        rounded = order(gguf_rounding(trainer.qat.types[path], rounds_to_fp16_first("q4_0"))(weight))
        assert np.array_equal(rounded.numpy(), in_base[name].reshape(rounded.shape)), name
        left, right = saved[path]
        a = torch.cat([module.lora_A["default"].weight.detach(), right])
        b = order(torch.cat([module.lora_B["default"].weight.detach() * module.scaling["default"], left], dim=1))
        assert a.shape[0] == trainer.cfg.lora.r + RANK
        assert np.array_equal(a.numpy(), in_lora[name + ".lora_a"].reshape(a.shape)), name
        assert np.array_equal(b.numpy(), in_lora[name + ".lora_b"].reshape(b.shape)), name


def test_llama_cpp_serves_the_corrected_pair_as_transformers_computes_it(corrected_run, tmp_path, capsys):
    """An f32 gguf-lora export (the base in float, the adapter and the correction beside it) scored
    in llama.cpp equals, on the held-out rows, the Transformers model whose adapted bases read
    W + L R; without the correction Transformers scores otherwise (the file holds it)."""
    from maximus.evaluate import heldout_loss
    from maximus.evaluate.deployed import score_gguf

    trainer = corrected_run
    run = trainer.run_dir
    out = tmp_path / "corrected-f32"
    assert main(["export", str(run), "--format", "gguf-lora", "--quant", "f32", "--out", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[:3] == [
        f"warning: {run} was trained for q4_0 (training.qat); --quant f32 rounds its weights differently than it "
        "trained for (omit --quant to write q4_0)",
        f"notice: adapter.gguf holds the run's rank-{RANK} correction of the base's q4_0 rounding beside the adapter "
        "(training.qat_correction_rank)",
        "warning: the correction beside the adapter makes up for the q4_0 rounding, and --quant f32 rounds the base "
        "otherwise (omit --quant to write q4_0)"]
    rows = trainer.data.eval
    served = score_gguf(out, trainer.tokenizer, rows, context=256, stops=[])
    saved, _ = load_corrections(run / "adapter")
    layers = {p: m for p, m in trainer.model.get_base_model().named_modules() if hasattr(m, "lora_A")}

    def loss() -> dict:
        return heldout_loss(trainer.model, rows, pad_token_id=trainer.tokenizer.pad_token_id,
                            device=torch.device("cpu"), dtype=torch.float32)

    plain = loss()
    with torch.no_grad():
        for path, (left, right) in saved.items():
            layers[path].get_base_layer()._parameters["weight"].add_(left @ right)
    try:
        corrected = loss()
    finally:
        with torch.no_grad():
            for path, (left, right) in saved.items():
                layers[path].get_base_layer()._parameters["weight"].sub_(left @ right)
    assert served["tokens"] == corrected["tokens"] > 0
    assert served["loss"] == pytest.approx(corrected["loss"], rel=1e-4)
    assert abs(served["loss"] - corrected["loss"]) < 0.05 * abs(plain["loss"] - corrected["loss"]), (served, plain)


def test_qat_correction_rank_is_refused_without_the_adapter_apart(tmp_path):
    def config(**training):
        return Config.from_dict(tiny_config(tmp_path / "m", tmp_path / "d.jsonl", tmp_path / "r", training=training))

    for training, line in [
        ({"qat": "q4_0", "qat_correction_rank": 8}, "config: training.qat_correction_rank 8 corrects the rounded base "
         "beside the adapter, and training.qat_adapter is merged (hint: set training.qat_adapter: separate (with "
         "training.qat a GGUF target) or remove training.qat_correction_rank)"),
        ({"qat_correction_rank": 2}, "config: training.qat_correction_rank 2 corrects the rounded base beside the "
         "adapter, and training.qat_adapter is merged (hint: set training.qat_adapter: separate (with training.qat a "
         "GGUF target) or remove training.qat_correction_rank)")]:
        with pytest.raises(ConfigError) as err:
            config(**training)
        assert err.value.one_line() == line
    with pytest.raises(ConfigError) as err:
        config(qat="q4_0", qat_adapter="separate", qat_correction_rank=-1)
    assert "training.qat_correction_rank" in err.value.one_line()


def test_a_qlora_base_reads_its_dequantized_rounding_plus_the_correction(tmp_path):
    """QLoRA: the NF4 base dequantized, rounded, plus L R; the layer's output is x (Q(W) + L R)^T +
    s (x A^T) B^T."""
    from maximus.models import load_model

    model_dir = build_tiny_model_dir(tmp_path / "model", "llama", hidden=64)
    cfg = Config.from_dict(tiny_config(model_dir, tmp_path / "d.jsonl", tmp_path / "run", method="qlora"))
    model, _ = load_model(cfg, device=torch.device("cpu"), method="qlora")
    layer = model.get_base_model().model.layers[0].self_attn.q_proj
    torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.5)
    import bitsandbytes.functional as bnb_f

    base = layer.get_base_layer().weight
    rounded = gguf_rounding("q4_0", fp16_first=False)(bnb_f.dequantize_4bit(base.data, base.quant_state).float())
    report = install_qat(model, "q4_0", adapter="separate")
    g = torch.Generator().manual_seed(0)
    left, right = torch.randn(64, 3, generator=g), torch.randn(3, 64, generator=g)
    apply_corrections(report, {"model.layers.0.self_attn.q_proj": (left, right)})
    assert torch.equal(fake_quantized_weight(layer), rounded + left @ right)
    model.train()
    x = torch.randn(2, 64)
    a, b, s = layer.lora_A["default"].weight, layer.lora_B["default"].weight, layer.scaling["default"]
    torch.testing.assert_close(layer(x), x @ (rounded + left @ right).T + s * (x @ a.T) @ b.T, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """A LoRA run on the same tiny base and data as `corrected_run`, trained without QAT."""
    return _train(tmp_path_factory.mktemp("plain"), qat="off", qat_adapter="merged", qat_correction_rank=0)


def test_export_correction_rank_calibrates_a_plain_run_as_training_would(plain_run, corrected_run, tmp_path, capsys):
    """`--correction-rank N` on a run trained without a correction writes the plain adapter with the
    correction the trainer computes for the same base and the first training rows beside it: A and
    s B bit for bit, L R as the corrected run saved it, beside the same rounded base."""
    import gguf

    run = plain_run.run_dir
    out = tmp_path / "post"
    capsys.readouterr()
    assert main(["export", str(run), "--format", "gguf-lora", "--quant", "q4_0", "--correction-rank", str(RANK),
                 "--out", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        f"notice: adapter.gguf holds a rank-{RANK} correction of the base's q4_0 rounding beside the adapter, "
        f"calibrated now on the run's first {min(CALIBRATION_ROWS, len(plain_run.data.train))} training rows "
        "(--correction-rank; the adapter trained without it)")
    saved, _ = load_corrections(corrected_run.run_dir / "adapter")
    in_lora = {t.name: np.asarray(t.data, np.float32) for t in gguf.GGUFReader(str(out / "adapter.gguf")).tensors}
    lm = plain_run.model.get_base_model()
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, lm.config.num_hidden_layers)
    v_proj = 0
    for path, module in lm.named_modules():
        if not hasattr(module, "lora_A") or not path.endswith("v_proj"):  # v, o, up, down: no RoPE row order
            continue
        v_proj += 1
        name = names.get_name(path + ".weight", try_suffixes=(".weight",))
        r = plain_run.cfg.lora.r
        a = in_lora[name + ".lora_a"].reshape(r + RANK, -1)
        b = in_lora[name + ".lora_b"].reshape(-1, r + RANK)
        assert np.array_equal(a[:r], module.lora_A["default"].weight.detach().numpy()), name
        assert np.array_equal(b[:, :r], (module.lora_B["default"].weight.detach() * module.scaling["default"]).numpy())
        left, right = saved[path]
        torch.testing.assert_close(torch.from_numpy(b[:, r:] @ a[r:]), left @ right, rtol=1e-3, atol=1e-6)
    assert v_proj == 2
    base = {t.name: t for t in gguf.GGUFReader(str(out / "model.gguf")).tensors}
    theirs = {t.name: t for t in gguf.GGUFReader(str(_export_apart(corrected_run, tmp_path) / "model.gguf")).tensors}
    assert sorted(base) == sorted(theirs)
    assert all(np.array_equal(base[n].data, theirs[n].data) for n in base)
    import json
    assert json.loads((out / ".maximus-export.json").read_text())["correction_rank"] == RANK


def _export_apart(trainer, tmp_path):
    out = tmp_path / "theirs"
    assert main(["export", str(trainer.run_dir), "--format", "gguf-lora", "--out", str(out)]) == 0
    return out


def test_export_correction_rank_is_refused_where_it_cannot_apply(plain_run, corrected_run, tmp_path, capsys):
    plain, corrected = plain_run.run_dir, corrected_run.run_dir
    capsys.readouterr()
    for argv, line in [
        ([str(plain), "--format", "gguf", "--correction-rank", "8"],
         "error: --correction-rank applies to the adapter file beside the base, which only --format gguf-lora "
         "writes, not --format gguf (hint: use --format gguf-lora or drop --correction-rank)"),
        ([str(plain), "--format", "ollama", "--adapter-dtype", "f16"],
         "error: --adapter-dtype applies to the adapter file beside the base, which only --format gguf-lora writes, "
         "not --format ollama (hint: use --format gguf-lora or drop --adapter-dtype)"),
        ([str(plain), "--format", "gguf-lora", "--correction-rank", "-2"],
         "error: --correction-rank must be a rank of 1 or more, not -2 (hint: drop it for no correction)"),
        ([str(plain), "--format", "gguf-lora", "--correction-rank", "8"],
         "error: --correction-rank 8 corrects the base's rounding, and Maximus models the rounding of q8_0, q4_0, "
         "q4_k_m, not --quant f16 (hint: pass --quant q4_k_m, q4_0 or q8_0, or drop --correction-rank)"),
        ([str(corrected), "--format", "gguf-lora", "--correction-rank", "8"],
         f"error: {corrected} already carries its rank-{RANK} correction of the base's q4_0 rounding "
         "(training.qat_correction_rank), and --correction-rank 8 would replace what the adapter trained against "
         "(hint: drop --correction-rank)")]:
        assert main(["export", *argv, "--out", str(tmp_path / "x")]) == 2, argv
        assert capsys.readouterr().err.strip().splitlines()[-1] == line
        assert not (tmp_path / "x").exists()


def test_adapter_dtype_f16_halves_the_lora_file_and_serves_as_the_f32_one(corrected_run, tmp_path, capsys):
    """`--adapter-dtype f16`: every A and B (the correction's rows too) is the f32 file's rounded to
    f16, bit for bit; the file is about half the size; llama.cpp scores the held-out rows with it as
    with the f32 file (relative 1e-3); the export says it rounded what trained in float32."""
    import gguf

    from maximus.evaluate.deployed import score_gguf

    run = corrected_run.run_dir
    written = {}
    for dtype in ("f32", "f16"):
        out = written[dtype] = tmp_path / dtype
        capsys.readouterr()
        assert main(["export", str(run), "--format", "gguf-lora", "--quant", "f32", "--adapter-dtype", dtype,
                     "--out", str(out)]) == 0
        said = capsys.readouterr().out.splitlines()
    assert said[3] == ("notice: adapter.gguf holds the adapter and its correction in f16, rounded from the float32 it "
                       "trained as (--adapter-dtype)")
    tensors = {d: {t.name: t for t in gguf.GGUFReader(str(written[d] / "adapter.gguf")).tensors} for d in written}
    assert sorted(tensors["f16"]) == sorted(tensors["f32"]) and len(tensors["f16"]) == 2 * 2 * 7
    for name, t in tensors["f16"].items():
        assert t.tensor_type == gguf.GGMLQuantizationType.F16, name
        assert np.array_equal(np.asarray(t.data), np.asarray(tensors["f32"][name].data).astype(np.float16)), name
    sizes = {d: (written[d] / "adapter.gguf").stat().st_size for d in written}
    assert 0.45 < sizes["f16"] / sizes["f32"] < 0.6, sizes
    rows = corrected_run.data.eval
    scores = {d: score_gguf(written[d], corrected_run.tokenizer, rows, context=256, stops=[]) for d in written}
    assert scores["f16"]["tokens"] == scores["f32"]["tokens"] > 0
    assert scores["f16"]["loss"] == pytest.approx(scores["f32"]["loss"], rel=1e-3)
