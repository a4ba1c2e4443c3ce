"""The low-memory optimizers (maximus.train.optimizers): each trains a tiny real Llama, saves and
resumes its whole state through the checkpoint files (resume == uninterrupted to 1e-5), steps
inside the backward exactly as outside it, and refuses bad input with one line."""
import json
import sys

import pytest
import torch

from maximus import Config, Trainer
from maximus.errors import ConfigError
from maximus.train.checkpoint import latest_good_checkpoint, save_checkpoint
from maximus.train.optimizers import build_optimizer, require_packages

from tiny import one_thread, tiny_config  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = ("adamw_4bit", "adamw_8bit_torchao", "apollo", "apollo_mini", "galore", "adam_mini", "muon")
#: The optimizers that leave embedding and head to AdamW, with torchao's 4-bit moments there instead.
FOUR_BIT_EMBEDDING = {"embedding_optimizer": "adamw_4bit"}


def _training(optimizer: str = "adamw", **extra):
    cfg = Config.from_dict({"model": "x", "dataset": "y", "method": "full",
                            "training": {"optimizer": optimizer, "learning_rate": 1e-3, "optimizer_rank": 8,
                                         "optimizer_update_gap": 2, **extra}})
    return cfg.training


def _model(tiny_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    model.train()
    return model


def _batches(n: int, vocab: int):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (2, 16), generator=g) for _ in range(n)]


def _run(model, optimizer, batches, scheduler=None):
    for ids in batches:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()


def _eager_torchao(optimizer: str):
    """torchao compiles its per-tensor step (`torch.compile(single_param_adam)`, tens of seconds per
    shape on CPU); here the same function runs eagerly, on the same 4-bit tensor subclasses."""
    from unittest import mock

    return mock.patch.object(torch, "compile", lambda fn, **kw: fn) if optimizer in ("adamw_4bit", "adamw_8bit_torchao") \
        else torch.enable_grad()


@pytest.mark.parametrize("in_backward", [False, True], ids=["step", "in_backward"])
@pytest.mark.parametrize("optimizer", NEW)
def test_resume_equals_uninterrupted(optimizer, in_backward, tiny_llama, tmp_path):
    """4 steps in one go == 2 steps, a checkpoint written and read back into a fresh model and
    optimizer, 2 more steps (to 1e-5), with a learning-rate schedule in between."""
    _assert_resume_equal(_training(optimizer, optimizer_in_backward=in_backward, max_grad_norm=None), optimizer,
                         tiny_llama, tmp_path)


@pytest.mark.parametrize("in_backward", [False, True], ids=["step", "in_backward"])
@pytest.mark.parametrize("optimizer", ["apollo_mini", "muon"])
def test_resume_equals_uninterrupted_with_4bit_embedding(optimizer, in_backward, tiny_llama, tmp_path):
    _assert_resume_equal(_training(optimizer, optimizer_in_backward=in_backward, max_grad_norm=None,
                                   **FOUR_BIT_EMBEDDING), "adamw_4bit", tiny_llama, tmp_path)


def _assert_resume_equal(training, optimizer: str, tiny_llama, tmp_path):
    with _eager_torchao(optimizer):
        ref = _model(tiny_llama)
        batches = _batches(4, ref.config.vocab_size)
        opt = build_optimizer(ref, training)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        _run(ref, opt, batches, sched)

        first = _model(tiny_llama)
        opt = build_optimizer(first, training)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        _run(first, opt, batches[:2], sched)
        save_checkpoint(tmp_path, 2, first, opt, {"scheduler": sched.state_dict()}, keep=1)
        json.loads((tmp_path / "step-000002" / "optimizer.json").read_text())  # plain JSON, no repr of objects

        resumed = _model(tiny_llama)
        opt = build_optimizer(resumed, training)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        state = latest_good_checkpoint(tmp_path).restore(resumed, opt)
        sched.load_state_dict(state["scheduler"])
        _run(resumed, opt, batches[2:], sched)
    moved = 0.0
    for (name, a), b, c in zip(ref.named_parameters(), resumed.parameters(), _model(tiny_llama).parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5, msg=name)
        moved = max(moved, float((a - c).abs().max()))
    assert moved > 1e-4  # the optimizer really trained


@pytest.mark.parametrize("optimizer", ["adamw", "apollo", "muon"])
def test_in_backward_equals_step_after_backward(optimizer, tiny_llama):
    """One optimizer per parameter stepped from its gradient hook == one optimizer stepped after
    the backward; the gradients are gone after the backward and the norm is the global one."""
    models, norms = [], []
    for in_backward in (False, True):
        model = _model(tiny_llama)
        opt = build_optimizer(model, _training(optimizer, optimizer_in_backward=in_backward, max_grad_norm=None))
        for ids in _batches(3, model.config.vocab_size):
            if in_backward:
                opt.begin_step()
            model(input_ids=ids, labels=ids).loss.backward()
            if in_backward:
                assert all(p.grad is None for p in model.parameters())
                norms.append(opt.grad_norm())
            else:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
            opt.step()
            opt.zero_grad(set_to_none=True)
        models.append(model)
    for a, b in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    assert norms[3:] == pytest.approx(norms[:3], rel=1e-5)


def test_muon_takes_decoder_matrices_and_adamw_the_rest(tiny_llama):
    model = _model(tiny_llama)
    opt = build_optimizer(model, _training("muon"))
    kinds = {type(part).__name__: sum(p.numel() for g in part.param_groups for p in g["params"]) for part in opt.parts}
    layers = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n and p.ndim == 2)
    assert kinds == {"Muon": layers, "AdamW": sum(p.numel() for p in model.parameters()) - layers}


@pytest.mark.parametrize("optimizer, own", [("apollo_mini", ["APOLLO"]), ("galore", ["GaLore"]),
                                             ("muon", ["AdamW", "Muon"])])
def test_4bit_embedding_takes_embedding_and_head(optimizer, own, tiny_llama):
    """embedding_optimizer: adamw_4bit = torchao's 4-bit AdamW over the embedding and the head,
    the optimizer's own parts over the rest (Muon: AdamW on the norms); every parameter once."""
    model = _model(tiny_llama)
    opt = build_optimizer(model, _training(optimizer, **FOUR_BIT_EMBEDDING))
    held = {type(part).__name__: [id(p) for g in part.param_groups for p in g["params"]] for part in opt.parts}
    outer = [id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)]
    assert sorted(held.pop("TorchaoAdamW")) == sorted(outer)
    assert sorted(held) == own
    rest = sorted(i for ids in held.values() for i in ids)
    assert rest == sorted(id(p) for p in model.parameters() if id(p) not in outer)


@pytest.mark.parametrize("optimizer", ["adamw_4bit", "adamw_8bit_torchao"])
def test_torchao_step_in_row_chunks_equals_the_whole_tensor_step(optimizer, tiny_llama, monkeypatch):
    """torchao's step over row chunks (4-bit and 8-bit blocks kept whole) == over the whole tensor,
    bit for bit: the update is elementwise and the quantisation per block of 128 (256)."""
    import maximus.train.optimizers.torchao_rows as optimizers

    models = []
    for chunk in (None, 1024):
        if chunk:
            monkeypatch.setattr(optimizers, "TORCHAO_CHUNK_VALUES", chunk)
        model = _model(tiny_llama)
        assert chunk is None or any(len(optimizers.row_chunks(p)) > 2 for p in model.parameters())
        opt = build_optimizer(model, _training(optimizer))
        _run(model, opt, _batches(3, model.config.vocab_size))
        assert type(opt.state[model.get_input_embeddings().weight]["exp_avg"]).__name__ == (
            "OptimState4bit" if optimizer == "adamw_4bit" else "OptimState8bit")
        models.append(model)
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)


def test_torchao_step_compiled_on_cpu_equals_the_eager_step_and_the_meter_sees_it_eager(monkeypatch):
    """A large tensor's torchao step on a CPU is compiled (inductor) outside the memory meter and
    eager under it; both give the same update (float32 rounding)."""
    import maximus.train.optimizers.torchao_rows as optimizers
    from maximus.memory.meter import MemoryMeter

    monkeypatch.setattr(optimizers, "CPU_COMPILE_MIN_VALUES", 4096)  # a small tensor: a quick compile
    g = torch.Generator().manual_seed(0)
    start = torch.randn(64, 64, generator=g)
    weights = [torch.nn.Parameter(start.clone()) for _ in range(2)]
    grads = [torch.randn(64, 64, generator=g) for _ in range(3)]
    opts = [optimizers.torchao_class(4)([w], lr=1e-2) for w in weights]
    for grad in grads:
        for w, opt in zip(weights, opts):
            w.grad = grad.clone()
        opts[0].step()
        with MemoryMeter("cpu").track(None, opts[1]):
            assert not optimizers._compiles(weights[1])
            opts[1].step()
    assert optimizers._compiles(weights[0]) and optimizers._cpu_compile["works"]
    torch.testing.assert_close(weights[0], weights[1], rtol=1e-6, atol=1e-7)
    assert (weights[0] - start).abs().min() > 0  # every value moved


def _cfg(**training):
    return Config.from_dict({"model": "x", "dataset": "y", "method": training.pop("method", "full"),
                             "training": training})


def test_missing_package_is_one_line_with_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "apollo_torch", None)  # what find_spec sees for an absent package
    with pytest.raises(ConfigError) as err:
        require_packages(_cfg(optimizer="apollo_mini"))
    assert str(err.value) == ("training.optimizer: apollo_mini needs the package apollo-torch, which is not installed "
                              "(hint: pip install apollo-torch)")


def test_rank_larger_than_a_weight_names_the_weight(tiny_llama):
    with pytest.raises(ConfigError) as err:
        build_optimizer(_model(tiny_llama), _training("galore", optimizer_rank=100))
    assert str(err.value).startswith("training.optimizer_rank 100 (galore) is larger than the smaller side of "
                                     "model.layers.0.self_attn.q_proj.weight ((64, 64))")


@pytest.mark.parametrize("training, message", [
    ({"optimizer_in_backward": True, "max_grad_norm": None, "batch_size": 4, "micro_batch_size": 2},
     "training.optimizer_in_backward: true updates each weight as soon as its gradient is ready: it cannot "
     "accumulate gradients over micro-batches (training.batch_size 4, micro_batch_size 2)"),
    ({"optimizer": "apollo", "method": "lora"}, "training.optimizer: apollo applies to method: full only (method is lora)"),
    ({"master_weights": "bf16", "optimizer": "muon"}, "training.master_weights: bf16 needs training.optimizer adamw, "
     "adamw_4bit or adamw_8bit_torchao (torchao's stochastic rounding), or apollo / apollo_mini / galore with optimizer_in_backward: true and "
     "embedding_optimizer: adamw_4bit, not muon"),
    ({"embedding_optimizer": "adamw_4bit", "optimizer": "adam_mini"}, "training.embedding_optimizer: adamw_4bit "
     "applies to the embedding and head that apollo / apollo_mini / galore / muon leave to AdamW in method: full "
     "(optimizer is adam_mini, method full)"),
])
def test_refused_combinations(training, message):
    with pytest.raises(ConfigError) as err:
        require_packages(_cfg(**training))
    assert err.value.message == message


def test_bf16_master_weights_hint_names_every_torchao_optimizer():
    with pytest.raises(ConfigError) as err:
        require_packages(_cfg(master_weights="bf16", optimizer="muon"))
    assert err.value.hint == "set training.optimizer: adamw, adamw_4bit or adamw_8bit_torchao, or master_weights: fp32"


def test_matryoshka_with_a_head_stepped_in_the_loss_backward_is_refused_at_config_read():
    def cfg(matryoshka):
        return Config.from_dict({"model": "x", "dataset": "y", "method": "full",
                                 "optimization": {"matryoshka": matryoshka},
                                 "training": {"optimizer": "apollo_mini", "embedding_optimizer": "adamw_4bit",
                                              "optimizer_in_backward": True, "max_grad_norm": None}})

    with pytest.raises(ConfigError) as err:
        require_packages(cfg({"dims": [16]}))
    assert err.value.message == (
        "training.optimizer_in_backward: true updates each weight as soon as its gradient is ready: with "
        "training.embedding_optimizer: adamw_4bit the head is updated block by block inside the loss's backward, "
        "and optimization.matryoshka's prefix losses would give it a second gradient in the same step")
    require_packages(cfg(None))  # the same setting without matryoshka is accepted


def test_trainer_runs_in_backward_and_reports_the_gradient_norm(tiny_llama, pc_data, tmp_path):
    cfg = tiny_config(tiny_llama, pc_data, tmp_path / "run", method="full", eval={"enabled": False},
                      training={"optimizer": "apollo_mini", "optimizer_in_backward": True, "max_grad_norm": None,
                                "micro_batch_size": 4, "max_steps": 2, "learning_rate": 1e-3})
    summary = Trainer(Config.from_dict(cfg)).train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["grad_norm"] > 0 for r in rows if "loss" in r] == [True, True]
    assert summary["plan"]["optimizer"] == "apollo_mini"


def test_clipping_inside_the_backward_equals_clip_grad_norm_then_step(tiny_llama, pc_data, tmp_path, capsys):
    """optimizer_in_backward with max_grad_norm: two backwards per step (the first measures the
    norm), the same weights, losses and logged norms as clip_grad_norm_ + the step after the
    backward; the clip really bites (every norm above max_grad_norm), and the run says so. With
    torchao's 8-bit AdamW, so the embedding and the head (stepped row block by row block inside
    the backward) are clipped too."""
    optimizer = "adamw_8bit_torchao"
    from safetensors.torch import load_file

    runs = {}
    for in_backward in (False, True):
        out = tmp_path / f"run-{in_backward}"
        cfg = tiny_config(tiny_llama, pc_data, out, method="full", eval={"enabled": False},
                          training={"optimizer": optimizer, "optimizer_in_backward": in_backward, "max_grad_norm": 0.5,
                                    "micro_batch_size": 4, "max_steps": 3, "learning_rate": 1e-3})
        with _eager_torchao(optimizer):
            Trainer(Config.from_dict(cfg)).train()
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[in_backward] = ([r for r in rows if r.get("loss") is not None], load_file(str(out / "model" / "model.safetensors")))
    (ref, ref_w), (ib, ib_w) = runs[False], runs[True]
    assert [r["loss"] for r in ib] == pytest.approx([r["loss"] for r in ref], rel=1e-5)
    assert [r["grad_norm"] for r in ib] == pytest.approx([r["grad_norm"] for r in ref], rel=1e-5)
    assert min(r["grad_norm"] for r in ref) > 0.5
    # 1e-5 is a hundredth of one step of lr 1e-3: a sub-ulp difference between the two orders of
    # summation can flip one 8-bit state code (seen on an AVX-512 Xeon: one gate_proj weight off by
    # 1.5e-6, every other weight within 1e-7)
    for name, w in ref_w.items():
        torch.testing.assert_close(ib_w[name], w, rtol=0, atol=1e-5, msg=name)
    assert ("notice: training.optimizer_in_backward with max_grad_norm 0.5: each step runs its backward twice (the "
            "first measures the gradient norm, the second steps on clipped gradients); set training.max_grad_norm: "
            "null for one backward, unclipped") in "".join(capsys.readouterr())


def test_plan_with_grad_accumulation_is_refused_in_backward(tiny_llama, pc_data, tmp_path):
    """The planner keeps one pass per step under optimizer_in_backward (no accumulation)."""
    from maximus.memory.spec_from_config import plan_run

    cfg = Config.from_dict(tiny_config(tiny_llama, pc_data, tmp_path / "run", method="full",
                                       training={"optimizer_in_backward": True, "max_grad_norm": None,
                                                 "micro_batch_size": "auto", "batch_size": 4}))
    plan = plan_run(cfg, device="cpu")
    assert (plan.micro_batch_size, plan.grad_accum) == (4, 1)


def test_bf16_weights_with_apollo_mini_in_backward_round_stochastically(tiny_llama):
    """master_weights: bf16 with APOLLO-Mini inside the backward: each decoder weight steps on a
    float32 copy rounded back stochastically, embedding and head on torchao's 4-bit AdamW (its own
    rounding); the loss falls as with float32 weights, and updates far below bf16's resolution
    still move the weights."""
    from transformers import AutoModelForCausalLM

    losses = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=dtype)
        model.train()
        opt = build_optimizer(model, _training("apollo_mini", optimizer_in_backward=True, max_grad_norm=None,
                                               **FOUR_BIT_EMBEDDING), bf16_weights=dtype is torch.bfloat16)
        ids = _batches(1, model.config.vocab_size)[0]
        before = model.model.layers[0].mlp.down_proj.weight.detach().clone()
        curve = []
        for _ in range(6):
            opt.begin_step()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            curve.append(float(loss))
        assert model.model.layers[0].mlp.down_proj.weight.dtype is dtype
        assert float((model.model.layers[0].mlp.down_proj.weight.detach() - before).abs().max()) > 0
        losses[dtype] = curve
    fp32, bf16 = losses[torch.float32], losses[torch.bfloat16]
    assert fp32[-1] < fp32[0] - 0.05 and bf16[-1] < bf16[0] - 0.05
    assert bf16[-1] == pytest.approx(fp32[-1], rel=0.02)


@pytest.mark.parametrize("training", [{"optimizer": "adamw_4bit"}, {"optimizer": "adamw_8bit_torchao"},
                                      {"optimizer": "apollo_mini", **FOUR_BIT_EMBEDDING}],
                         ids=["adamw_4bit", "adamw_8bit_torchao", "apollo_mini+4bit_embedding"])
def test_head_and_embedding_stepped_row_by_row_equal_the_whole_gradient_step(training, tiny_llama, monkeypatch):
    """Inside the backward, the head updated block of vocabulary rows by block inside the chunked
    loss's backward, and the embedding inside its own, never hold a whole gradient, and equal the
    same optimizer stepped from the whole gradients, after one step and after three: every value
    within lr / 20 and all but 0.02 % to 1e-6 (both gradients are float32 sums in different orders,
    and Adam's first update g / (|g| + eps) amplifies that rounding where |g| is near eps = 1e-8);
    the step's norms to 1e-5."""
    import maximus.train.optimizers.torchao_rows as optimizers
    from maximus.losses.linear_cross_entropy import linear_cross_entropy

    monkeypatch.setattr(optimizers, "TORCHAO_CHUNK_VALUES", 1024)  # several row blocks per tiny weight
    after_one, models, norms = [], [], []
    for row_steps in (False, True):
        model = _model(tiny_llama)
        head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
        assert len(optimizers.row_chunks(head)) > 2 and len(optimizers.row_chunks(embed)) > 2
        opt = build_optimizer(model, _training(optimizer_in_backward=True, max_grad_norm=None, **training),
                              row_steps=row_steps)
        for ids in _batches(3, model.config.vocab_size):
            opt.begin_step()
            hidden = model.model(input_ids=ids).last_hidden_state
            labels = ids[:, 1:].masked_fill(ids[:, 1:] % 5 == 0, -100)  # some ignored targets
            loss = linear_cross_entropy(hidden[:, :-1], head, labels, chunk_size=8, reduction="sum")
            (loss / 17.0).backward()
            assert head.grad is None and embed.grad is None
            norms.append(opt.grad_norm())
            if len(norms) % 3 == 1:
                after_one.append([p.detach().clone() for p in model.parameters()])
        opt.remove_hooks()
        models.append(model)
    names = [n for n, _ in models[0].named_parameters()]
    for whole, rows in (after_one, [list(m.parameters()) for m in models]):
        off = 0
        for name, a, b in zip(names, whole, rows):
            diff = (a - b).abs()
            assert float(diff.max()) < 1e-3 / 20, name
            off += int((diff > 1e-6).sum())
        assert off <= sum(p.numel() for p in whole) // 5000
    moved = max(float((a - c).abs().max()) for a, c in zip(models[0].parameters(), _model(tiny_llama).parameters()))
    assert moved > 1e-4
    assert norms[3:] == pytest.approx(norms[:3], rel=1e-5)


def test_head_gradient_by_row_blocks_is_as_exact_as_the_whole_one(tiny_llama):
    """The head's gradient as the loss hands it out block of rows by block (`step_rows_in_loss`)
    against float64 autograd: as close as the whole float32 gradient is, and complete."""
    from maximus.losses.linear_cross_entropy import linear_cross_entropy, step_rows_in_loss

    model = _model(tiny_llama)
    weight = model.get_output_embeddings().weight
    ids = _batches(1, model.config.vocab_size)[0]
    labels = ids[:, 1:].masked_fill(ids[:, 1:] % 5 == 0, -100)
    hidden = model.model(input_ids=ids).last_hidden_state.detach()[:, :-1]

    class Capture:
        chunks = [slice(a, a + 48) for a in range(0, weight.shape[0], 48)]
        grad = torch.full_like(weight, float("nan"))

        def __call__(self, rows, grad):
            self.grad[rows] = grad

    whole = torch.autograd.grad(linear_cross_entropy(hidden, weight, labels, chunk_size=8, reduction="sum") / 7, weight)[0]
    step_rows_in_loss(weight, capture := Capture())
    try:
        h = hidden.clone().requires_grad_(True)
        (linear_cross_entropy(h, weight, labels, chunk_size=8, reduction="sum") / 7).backward()
    finally:
        step_rows_in_loss(weight, None)
    assert weight.grad is None
    w64, h64 = (t.detach().double().requires_grad_(True) for t in (weight, hidden))
    loss64 = torch.nn.functional.cross_entropy((h64 @ w64.t()).flatten(0, 1), labels.flatten(), reduction="sum")
    oracle, oracle_hidden = torch.autograd.grad(loss64 / 7, (w64, h64))
    err_whole = float((whole.double() - oracle).abs().max())
    err_rows = float((capture.grad.double() - oracle).abs().max())
    assert err_rows <= 2 * err_whole + 1e-7
    torch.testing.assert_close(h.grad.double(), oracle_hidden, rtol=0, atol=1e-6)


@pytest.mark.parametrize("scheduler,after", [("constant", [1.0, 1.0, 1.0]), ("linear", [1.0, 0.9, 0.8]),
                                             ("cosine", [1.0, 0.975528, 0.904508])])
def test_the_learning_rate_warms_up_from_one_over_warmup_plus_one_then_decays(scheduler, after):
    from maximus.train.trainer import lr_factor

    t = Config.from_dict({"model": "x", "dataset": "y",
                          "training": {"warmup_steps": 5, "scheduler": scheduler}}).training
    factors = [lr_factor(step, t, total_steps=15) for step in range(8)]
    assert factors == pytest.approx([1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6, *after], abs=1e-6)
    half = Config.from_dict({"model": "x", "dataset": "y", "training": {"warmup_steps": 0.2}}).training
    assert lr_factor(0, half, total_steps=10) == pytest.approx(1 / 3)  # 0.2 x 10 = 2 warm-up steps
