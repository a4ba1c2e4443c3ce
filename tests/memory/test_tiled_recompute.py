"""Sequence-tiled recompute (`optimization.tile_tokens`): the MLP of a fully checkpointed layer runs
over tiles of tokens in backward; losses and every LoRA gradient equal the untiled ones (1e-5, fp32)."""
from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from maximus.config import Config
from maximus.errors import ConfigError, ModelError
from maximus.kernels.tiled_mlp import tile_ranges, tiled_mlp
from maximus.memory.checkpointing import apply_checkpointing, remove_checkpointing
from maximus.structure import find_decoder_layers
from maximus.memory.meter import measure_step_peak

from tiny import backward_node_names, build_tiny_model_dir, one_thread  # noqa: F401,E402  (one_thread: a fixture, used through pytestmark)

pytestmark = pytest.mark.usefixtures("one_thread")

BATCH, SEQ, TILE = 2, 24, 7  # 48 rows in 7 tiles, the last one shorter


def _lora(model_dir, method):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kwargs = dict(dtype=torch.float32)
    if method == "qlora":
        from peft import prepare_model_for_kbit_training

        kwargs.update(device_map={"": "cpu"}, quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)
    if method == "qlora":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                                             use_dora=method == "dora"))
    return model.train()


def _step(model):
    ids = torch.randint(3, 250, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _assert_same(got, expected):
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-6)
    assert got[1].keys() == expected[1].keys() and len(expected[1]) >= 28
    for name, grad in expected[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("arch,method", [("llama", "lora"), ("mistral", "lora"), ("qwen2", "lora"),
                                         ("llama", "qlora"), ("qwen2", "qlora"), ("llama", "dora")])
def test_tiled_equals_untiled_full_checkpointing(tiny_model_dirs, arch, method):
    untiled = _lora(tiny_model_dirs[arch], method)
    apply_checkpointing(untiled, "full", micro_batch=BATCH, seq_len=SEQ)
    expected = _step(untiled)
    tiled = _lora(tiny_model_dirs[arch], method)
    report = apply_checkpointing(tiled, "full", micro_batch=BATCH, seq_len=SEQ, tile_tokens=TILE)
    assert report.tile_tokens == TILE and report.to_dict()["tile_tokens"] == TILE
    _assert_same(_step(tiled), expected)


def test_tiled_equals_no_checkpointing_and_the_mlp_runs_once_per_tile_each_way(tiny_llama):
    expected = _step(_lora(tiny_llama, "lora"))
    model = _lora(tiny_llama, "lora")
    apply_checkpointing(model, "full", micro_batch=BATCH, seq_len=SEQ, tile_tokens=TILE)
    _, layers = find_decoder_layers(model)
    calls = []
    handles = [layer.mlp.gate_proj.register_forward_hook(lambda m, a, o: calls.append(a[0].shape[-2]))
               for layer in layers]
    got = _step(model)
    for h in handles:
        h.remove()
    _assert_same(got, expected)
    # forward: 7 tiles; backward: 7 tiles again; the layer's checkpoint recompute skips the MLP.
    tiles = [e - s for s, e in tile_ranges(BATCH * SEQ, TILE)]
    assert calls == (tiles * 2) * len(layers)


def test_tile_covering_the_micro_batch_is_one_untiled_pass(tiny_llama):
    model = _lora(tiny_llama, "lora")
    apply_checkpointing(model, "full", micro_batch=BATCH, seq_len=SEQ, tile_tokens=BATCH * SEQ)
    ids = torch.randint(3, 250, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    assert "_TiledMLPFunctionBackward" not in backward_node_names(model(input_ids=ids, labels=ids).loss)
    apply_checkpointing(model, "full", micro_batch=BATCH, seq_len=SEQ, tile_tokens=BATCH * SEQ - 1)
    assert "_TiledMLPFunctionBackward" in backward_node_names(model(input_ids=ids, labels=ids).loss)


def test_only_fully_recomputed_layers_are_tiled_and_remove_restores_the_classes(tiny_llama):
    model = _lora(tiny_llama, "lora")
    _, layers = find_decoder_layers(model)
    mlp_class = type(layers[0].mlp)
    report = apply_checkpointing(model, ["full", "selective"], micro_batch=BATCH, seq_len=SEQ, tile_tokens=TILE)
    assert report.tile_tokens == TILE
    assert layers[0].mlp._maximus_tile_tokens == TILE and "_maximus_tile_tokens" not in layers[1].mlp.__dict__
    assert type(layers[0].mlp).__name__ == mlp_class.__name__ and isinstance(layers[0].mlp, mlp_class)
    assert apply_checkpointing(model, "selective", micro_batch=BATCH, seq_len=SEQ, tile_tokens=TILE).tile_tokens is None
    assert "_maximus_tile_tokens" not in layers[0].mlp.__dict__
    apply_checkpointing(model, "full", micro_batch=BATCH, seq_len=SEQ, tile_tokens=TILE)
    remove_checkpointing(model)
    assert type(layers[0].mlp) is mlp_class and "_maximus_tile_tokens" not in layers[0].mlp.__dict__


def test_dropout_masks_are_replayed_tile_by_tile():
    """With dropout, tiles draw their own masks; backward must see the masks forward used. Oracle:
    plain autograd through the same tiles in the same order from the same seed."""
    torch.manual_seed(0)
    up, down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
    drop = torch.nn.Dropout(0.5)

    def run(t):
        return down(torch.nn.functional.silu(up(drop(t))))

    x = torch.randn(2, 11, 8, requires_grad=True)
    params = list(up.parameters()) + list(down.parameters())
    torch.manual_seed(3)
    out = tiled_mlp(run, x, 4, params)
    got = torch.autograd.grad((out * out).sum(), [x] + params)
    torch.manual_seed(3)
    rows = x.reshape(-1, 8)
    ref_out = torch.cat([run(rows[s:e].unsqueeze(0)).squeeze(0) for s, e in tile_ranges(22, 4)]).view(2, 11, 8)
    expected = torch.autograd.grad((ref_out * ref_out).sum(), [x] + params)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7)


def test_tiling_lowers_the_measured_peak(tiny_model_dirs, tmp_path):
    """A layer whose MLP is wide (intermediate 8x hidden): the recomputed layer's backward holds one
    tile of the intermediate tensors instead of all of them."""
    model_dir = build_tiny_model_dir(tmp_path / "wide", "llama", hidden=64, layers=2)
    import json

    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["intermediate_size"] = 1024
    (model_dir / "config.json").write_text(json.dumps(cfg))
    from transformers import AutoModelForCausalLM

    ids = torch.randint(3, 250, (1, 512), generator=torch.Generator().manual_seed(1))

    def peak(tile):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                     ignore_mismatched_sizes=True)
        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear")).train()
        apply_checkpointing(model, "full", micro_batch=1, seq_len=512, tile_tokens=tile)

        def step():
            model(input_ids=ids, labels=ids).loss.backward()
        return measure_step_peak(step, model)[0]

    untiled, tiled = peak(None), peak(64)
    # Untiled, the recomputed MLP holds ~ 512 tokens x 1024 x (gate, up, act, product, LoRA inputs)
    # float32 = several MiB; tiled, a 64-token slice of it.
    assert untiled - tiled > 4 * 512 * 1024 * 4 * 0.75


def test_bad_tile_tokens_is_a_one_line_error(tiny_llama):
    with pytest.raises(ConfigError) as err:
        Config.from_dict({"model": "m", "dataset": "d", "optimization": {"tile_tokens": 0}})
    assert str(err.value).splitlines()[0] == (
        "config: invalid value for 'optimization.tile_tokens': 0: must be a positive number of tokens, auto or off"
        " (hint: see docs/config.md for allowed values)")
    model = _lora(tiny_llama, "lora")
    with pytest.raises(ConfigError, match=r"^optimization.tile_tokens must be a positive number of tokens, auto or "
                                          r"off, got -4 \(hint: use e.g. tile_tokens: 4096, or off\)$"):
        apply_checkpointing(model, "full", micro_batch=1, seq_len=8, tile_tokens=-4)


def test_a_layer_without_mlp_cannot_be_tiled(tiny_llama):
    model = _lora(tiny_llama, "lora")
    _, layers = find_decoder_layers(model)
    layers[1].ffn = layers[1].mlp
    del layers[1].mlp
    with pytest.raises(ModelError, match="the decoder layer LlamaDecoderLayer has no `mlp` module to tile"):
        apply_checkpointing(model, "full", micro_batch=1, seq_len=8, tile_tokens=4)


def test_trainer_tiles_when_asked_and_trains_the_same(tiny_llama, pc_data, tmp_path):
    import json

    from maximus import Trainer
    from tiny import tiny_config

    def run(name, **opt):
        cfg = tiny_config(tiny_llama, pc_data, tmp_path / name, training={"max_steps": 2},
                          optimization={"gradient_checkpointing": "full", **opt}, eval={"before": False})
        Trainer(Config.from_dict(cfg)).train()
        summary = json.loads((tmp_path / name / "run.json").read_text())
        losses = [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
                  if '"loss"' in line]
        return summary, losses

    tiled, tiled_losses = run("tiled", tile_tokens=16)
    untiled, untiled_losses = run("untiled", tile_tokens="off")
    assert tiled["checkpointing"]["tile_tokens"] == 16 and untiled["checkpointing"]["tile_tokens"] is None
    assert len(tiled_losses) == 2
    torch.testing.assert_close(torch.tensor(tiled_losses), torch.tensor(untiled_losses), rtol=1e-5, atol=1e-6)


def test_tiling_composes_with_activation_offload(tiny_llama):
    """Checkpointed layer inputs moved to host memory and back (the offloader), MLP tiled on top."""
    expected = _step(_lora(tiny_llama, "lora"))
    model = _lora(tiny_llama, "lora")
    report = apply_checkpointing(model, "full", micro_batch=BATCH, seq_len=SEQ, tile_tokens=TILE,
                                 offload_activations=True)
    assert report.offload_activations and report.tile_tokens == TILE
    _assert_same(_step(model), expected)
    _, layers = find_decoder_layers(model)
    assert layers[0]._maximus_offloader.stats.offloaded_tensors == len(layers)


def test_tiling_keeps_kronecker_attention(tiny_llama):
    """Attention stays Kronecker Sketching (past its detail budget, so the sketch runs), MLP tiled."""
    from transformers import AutoModelForCausalLM

    from maximus.attention import install_kronecker
    from maximus.config import KroneckerConfig

    def build():
        model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
        model = install_kronecker(model, KroneckerConfig(detail_tokens=8, sketch_slots=4, block=4))
        torch.manual_seed(0)
        return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "gate_proj", "down_proj"],
                                                init_lora_weights=False)).train()
    untiled = build()
    apply_checkpointing(untiled, "full", micro_batch=BATCH, seq_len=SEQ)
    expected = _step(untiled)
    tiled = build()
    apply_checkpointing(tiled, "full", micro_batch=BATCH, seq_len=SEQ, tile_tokens=TILE)
    got = _step(tiled)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-6)
    assert got[1].keys() == expected[1].keys() and len(expected[1]) == 12
    for name, grad in expected[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_trainer_tiles_when_the_budget_needs_it_and_stays_under_it(tiny_llama, pc_data, tmp_path):
    """tile_tokens: auto with a budget that untiled plans miss: the planner's tile reaches the layers."""
    import json

    from maximus import Trainer
    from maximus.errors import BudgetError
    from maximus.memory.shape import load_model_config
    from maximus.memory.planner import plan_for_budget
    from tiny import tiny_config

    budget = 3_300_000
    kw = dict(method="lora", batch_size=2, seq_len=256, micro_batch_size=2, dtype="fp32", lora_r=4, device="cpu")
    with pytest.raises(BudgetError):
        plan_for_budget(load_model_config(str(tiny_llama)), budget, tile_tokens="off", **kw)
    cfg = tiny_config(tiny_llama, pc_data, tmp_path / "run", eval={"before": False},
                      training={"max_steps": 1, "seq_len": 256, "batch_size": 2, "micro_batch_size": 2},
                      optimization={"gradient_checkpointing": "auto", "target_vram": budget})
    Trainer(Config.from_dict(cfg)).train()
    summary = json.loads((tmp_path / "run" / "run.json").read_text())
    assert summary["plan"]["tile_tokens"] == 256 and summary["checkpointing"]["tile_tokens"] == 256
    assert "the MLP of each fully recomputed layer runs over 2 tiles of 256 tokens in backward" in summary["plan"]["notes"]
    assert summary["memory"]["peak_bytes"] <= budget
