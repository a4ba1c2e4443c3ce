"""Oracle: TRL's GRPOTrainer loss and gradients on the same tiny model, completions and rewards.

TRL builds its batch itself (`_generate_and_score_completions`: prompt tokens, rewards,
advantages, reference log-probs with the LoRA adapter disabled, the sampling policy's log-probs
for `num_iterations` > 1), with the completions injected (a random model rarely says EOS, and the
test needs completions of several lengths, some ending in EOS, some truncated). Our objective
scores the same completions with the same reward function and takes its own log-probs through the
chunked head. Then the adapter is perturbed (as an update would), so importance ratios move and
both clip edges are hit, and both losses and their LoRA gradients are compared.
"""
import pytest
import torch

from maximus.memory import Plan

from tiny import build_tiny_model_dir, one_thread  # noqa: F401  (one_thread: a fixture, used through pytestmark)

trl = pytest.importorskip("trl")
pytestmark = pytest.mark.usefixtures("one_thread")

GROUP, MAX_TOKENS = 4, 8
PROMPTS = [("Reverse: red blue gold\nAnswer:", "gold blue red"), ("Reverse: tiger north\nAnswer:", "north tiger")]


def length_reward(prompts, completions, answer, **columns):
    """Varies within a group; None (skipped) for one completion, which then gets advantage 0."""
    return [None if len(c) == 5 else float(len(c) % 4) + 0.5 * (a == "gold blue red") for c, a in zip(completions, answer)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("grpo_oracle") / "model")


def injected_completions(eos: int) -> list[list[int]]:
    """Per completion (prompt-major): token ids, ending in EOS or cut at MAX_TOKENS."""
    g = torch.Generator().manual_seed(3)
    lengths = [3, 8, 5, 1, 8, 2, 6, 4]
    out = []
    for i, n in enumerate(lengths):
        ids = torch.randint(10, 250, (n,), generator=g).tolist()
        if i not in (1, 4):  # two truncated completions keep all MAX_TOKENS tokens, no EOS
            ids[-1] = eos
        out.append(ids)
    return out


@pytest.mark.parametrize("loss_type,kl_correction,scale", [("grpo", True, "group"), ("dr_grpo", True, "none"),
                                                           ("dapo", True, "batch"), ("dapo", False, "group")])
def test_loss_and_gradients_equal_trl_grpo_trainer(model_dir, tmp_path, loss_type, kl_correction, scale):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    import maximus
    from maximus.train.objectives.grpo import GRPOObjective
    from maximus.train.views import RunView

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    dataset = Dataset.from_list([{"prompt": p, "answer": a} for p, a in PROMPTS])
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=GROUP * len(PROMPTS),
                      num_generations=GROUP, max_completion_length=MAX_TOKENS, beta=0.1, epsilon=0.2,
                      epsilon_high=0.28, loss_type=loss_type, temperature=0.7, num_iterations=2,
                      scale_rewards=scale, use_bias_correction_kl=kl_correction, use_cpu=True, report_to=[], bf16=False, seed=0)
    trainer = GRPOTrainer(model=model, reward_funcs=[length_reward], args=args, train_dataset=dataset,
                          processing_class=tok,
                          peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    completions = injected_completions(tok.eos_token_id)
    trainer._generate_single_turn = lambda prompt_ids, *a, **k: (completions, None)
    trainer.model.train()
    inputs = trainer._generate_and_score_completions([dataset[i] for i in range(len(PROMPTS)) for _ in range(GROUP)])
    assert inputs["completion_mask"].sum(1).tolist() == [3, 8, 5, 1, 8, 2, 6, 4]

    # Ours: the same prompts (TRL's tokens), completions and reward function; our own log-probs.
    cfg = maximus.Config.from_dict({
        "model": str(model_dir), "dataset": "unused.jsonl", "objective": "grpo",
        "training": {"micro_batch_size": 3, "dtype": "fp32"},
        "grpo": {"group_size": GROUP, "max_completion_tokens": MAX_TOKENS, "temperature": 0.7, "beta": 0.1,
                 "epsilon": 0.2, "epsilon_high": 0.28, "updates_per_generation": 2, "loss_type": loss_type,
                 "kl_ratio_correction": kl_correction,
                 "scale_rewards": scale, "rewards": [f"{__file__}:length_reward"]}})
    plan = Plan(method="lora", micro_batch_size=3, grad_accum=1, recompute=(), offload_activations=False,
                offload_optimizer=False, optimizer="adamw", loss_mode="exact", loss_chunk_size=5, peak_bytes=None,
                breakdown={}, budget_bytes=None, margin_bytes=0, objective="grpo")
    objective = GRPOObjective(cfg, plan, tok.pad_token_id)
    prompt_rows = [{"prompt_ids": ids[m.bool()].tolist(), "prompt": p, "columns": {"answer": a}, "where": f"p{i}"}
                   for i, ((p, a), ids, m) in enumerate(zip(PROMPTS, inputs["prompt_ids"][::GROUP],
                                                             inputs["prompt_mask"][::GROUP]))]
    run = RunView(model=trainer.model, tokenizer=tok, data=None, device=torch.device("cpu"), dtype=torch.float32,
                  method="lora", run_dir=tmp_path, total_steps=1, dist=None, tasks=None, rows_for_step=None)
    per_prompt = [completions[i * GROUP:(i + 1) * GROUP] for i in range(len(PROMPTS))]
    gen = objective.build_generation(run, 0, prompt_rows, per_prompt)
    torch.testing.assert_close(gen.advantages, inputs["advantages"].float(), rtol=1e-5, atol=1e-6)
    assert gen.advantages.tolist().count(0.0) == 1  # the completion the reward skipped
    objective.generation = gen

    # An update moves the policy away from the one that sampled.
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    trainer.current_gradient_accumulation_steps = 1
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    trl_loss = trainer.compute_loss(trainer.model, inputs)
    trl_grads = torch.autograd.grad(trl_loss, params)

    batches = objective.step_batches(run, 1)
    assert [b["input_ids"].shape[0] for b in batches] == [3, 3, 2]
    units = sum(objective.count(b) for b in batches)
    ours = sum(objective.loss_sum(trainer.model, b)[0] for b in batches) / units
    our_grads = torch.autograd.grad(ours, params)
    torch.testing.assert_close(ours.float(), trl_loss.float(), rtol=1e-5, atol=1e-7)
    scale = max(float(g.abs().max()) for g in trl_grads)
    for a, b in zip(our_grads, trl_grads):  # float32: chunked head vs TRL's full-logits head
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * scale)
    metrics = objective.step_metrics()
    assert metrics["clip_ratio/low"] > 0 and metrics["clip_ratio/high"] > 0
    assert metrics["clip_ratio/low"] == pytest.approx(trainer._metrics["train"]["clip_ratio/low_mean"][-1], rel=1e-5)
    assert metrics["clip_ratio/high"] == pytest.approx(trainer._metrics["train"]["clip_ratio/high_mean"][-1], rel=1e-5)
    assert metrics["kl"] == pytest.approx(trainer._metrics["train"]["kl"][-1], rel=1e-5)
    assert metrics["reward"] == pytest.approx(trainer._metrics["train"]["reward"][-1], rel=1e-6)
