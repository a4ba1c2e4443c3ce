"""objective: grpo end to end on a tiny random Llama: prompt data, generation, rewards, metrics,
resume, errors. The loss itself is checked against the formulas (tests/losses/test_grpo_loss.py)
and against TRL's GRPOTrainer (test_grpo_trl_oracle.py)."""
import json
import random
from pathlib import Path

import pytest
import torch

import maximus
from maximus.data import build_datasets
from maximus.data.encoding import Encoder
from maximus.errors import ConfigError, DataError, RewardError
from maximus.train.rewards import exact_answer, normalise_answer, regex_format
from tiny import build_tiny_model_dir, one_thread, tiny_config  # noqa: F401  (one_thread: a fixture, used through pytestmark)

pytestmark = pytest.mark.usefixtures("one_thread")
REWARDS = Path(__file__).with_name("grpo_test_rewards.py")
WORDS = "red green blue gold stone river cloud tiger eagle maple north south".split()
G, MAX_TOKENS = 4, 6


def write_prompts(path: Path, n: int = 12, chat: bool = False) -> Path:
    rng = random.Random(0)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            words = rng.sample(WORDS, 3)
            prompt = f"Reverse: {' '.join(words)}\nAnswer:"
            record = {"prompt": [{"role": "user", "content": prompt}] if chat else prompt,
                      "answer": " ".join(reversed(words)), "topic": "colours", "id": i}
            f.write(json.dumps(record) + "\n")
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    return {"model": build_tiny_model_dir(root / "model"), "data": write_prompts(root / "prompts.jsonl"),
            "chat": write_prompts(root / "chat.jsonl", chat=True)}


def config(tiny, out, grpo=None, training=None, eval=None, **over):
    cfg = tiny_config(tiny["model"], tiny["data"], out, objective="grpo",
                      grpo={"group_size": G, "max_completion_tokens": MAX_TOKENS,
                            "rewards": [f"{REWARDS}:word_count"], **(grpo or {})},
                      training={"batch_size": 2, "micro_batch_size": 2, "max_steps": 2, "learning_rate": 5e-2,
                                "warmup_steps": 0, "scheduler": "constant", "seq_len": 64, **(training or {})},
                      eval={"split": 0.25, "before": True, **(eval or {})}, **over)
    cfg["dataset"]["format"] = "prompt"
    return cfg


def metrics_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------ data
def test_prompt_rows_keep_the_other_columns_and_tokenize_like_prompt_completion(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny["model"])
    spec = maximus.Config.from_dict(config(tiny, Path("unused"))).datasets[0]
    splits = build_datasets([spec], tok, seq_len=64, objective="grpo", eval_split=0.25)
    assert (len(splits.train), len(splits.eval)) == (9, 3)
    row = splits.train[0]
    encoder = Encoder(tok)
    assert row["prompt_ids"] == encoder.prefix_ids + encoder.tokens(row["prompt"])
    assert set(row["columns"]) == {"answer", "topic", "id"} and row["columns"]["topic"] == "colours"
    assert row["where"].startswith(f"{tiny['data']}:")
    # Chat prompts: the template's text with the generation prompt; too long: the end is kept.
    chat_spec = spec.model_copy(update={"path": str(tiny["chat"])})
    chat = build_datasets([chat_spec], tok, seq_len=64, objective="grpo", eval_split=0.0)
    first = chat.train[0]
    text = tok.apply_chat_template(first["prompt"], tokenize=False, add_generation_prompt=True)
    assert first["prompt_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    cut = build_datasets([chat_spec], tok, seq_len=8, objective="grpo", eval_split=0.0)
    assert cut.train[0]["prompt_ids"] == first["prompt_ids"][-8:] and cut.stats["truncated"] == 12


def test_prompt_format_errors_name_the_format_and_objective(tiny, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny["model"])
    spec = maximus.Config.from_dict(config(tiny, tmp_path)).datasets[0]
    with pytest.raises(DataError, match=r"^objective grpo needs prompt records \(a prompt, plus columns for the rewards\); "
                                        r".*prompts.jsonl has format prompt_completion \(hint: set `format: prompt`"):
        build_datasets([spec.model_copy(update={"format": "prompt_completion"})], tok, seq_len=64, objective="grpo")
    with pytest.raises(DataError, match=r"^format prompt \(prompts without answers to learn\) is for objective grpo; "
                                        r".*prompts.jsonl is used with objective sft"):
        build_datasets([spec], tok, seq_len=64, objective="sft")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "hi"}) + "\n")
    with pytest.raises(DataError, match=r"^\S*bad.jsonl:1: missing field 'prompt' for format prompt \(record has \['question'\]\)"):
        build_datasets([spec.model_copy(update={"path": str(bad)})], tok, seq_len=64, objective="grpo")


# ------------------------------------------------------------------------------ training
def test_a_run_logs_rewards_kl_clipping_and_keeps_the_old_policy_between_updates(tiny, tmp_path):
    out = tmp_path / "run"
    cfg = config(tiny, out, grpo={"beta": 0.1, "updates_per_generation": 2, "loss_type": "grpo",
                                  "rewards": [f"{REWARDS}:word_count", "exact_answer"], "reward_weights": [0.5, 2.0]},
                 training={"max_steps": 4})
    summary = maximus.Trainer(maximus.Config.from_dict(cfg)).train()
    rows = metrics_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["reward"] == pytest.approx(0.5 * r["reward/word_count"] + 2.0 * r["reward/exact_answer"])
        assert 1 <= r["completion_length"] <= MAX_TOKENS and 0 <= r["completions_truncated"] <= 1
        assert r["kl"] >= 0 and r["clip_ratio"] == pytest.approx(r["clip_ratio/low"] + r["clip_ratio/high"])
        assert r["rewards_dropped"] == 0 and r["tokens_per_s"] > 0 and r["peak_memory_bytes"] > 0
    # Steps 1 and 3 sample; 2 and 4 update again on the same completions against the kept log-probs.
    assert ["generation_s" in r for r in rows] == [True, False, True, False]
    assert rows[1]["reward"] == rows[0]["reward"] and rows[3]["reward"] == rows[2]["reward"]
    assert rows[0]["kl"] == 0.0 and rows[0]["clip_ratio"] == 0.0  # the fresh adapter is the reference; ratio 1
    assert rows[1]["kl"] > 0 and rows[1]["clip_ratio"] > 0  # one update later (lr 5e-2): moved and clipped
    before, after = summary["eval"]["before"], summary["eval"]["after"]
    assert before["prompts"] == after["prompts"] == 3
    assert set(after) >= {"reward", "reward/word_count", "reward/exact_answer", "completion_length"}


def test_resume_samples_the_same_completions_and_ends_with_the_same_adapter(tiny, tmp_path):
    from safetensors.torch import load_file

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    maximus.Trainer(maximus.Config.from_dict(config(tiny, straight, training={"max_steps": 4}))).train()
    maximus.Trainer(maximus.Config.from_dict(config(tiny, resumed, training={"max_steps": 2}))).train()
    maximus.Trainer(maximus.Config.from_dict(config(tiny, resumed, training={"max_steps": 4}))).train()
    a, b = metrics_rows(straight), metrics_rows(resumed)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for x, y in zip(a, b):
        assert (x["reward"], x["completion_length"]) == (y["reward"], y["completion_length"])
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-7)
    wa = load_file(str(straight / "adapter" / "adapter_model.safetensors"))
    wb = load_file(str(resumed / "adapter" / "adapter_model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-7)


def test_the_sampled_meter_decides_after_sampling_and_keeps_the_runs_peak(tiny, tmp_path):
    runs, steps = {}, 5  # metered: the first two, step 3 (its rows), the last; step 4 not
    for mode in ("every_step", "sampled"):
        out = tmp_path / mode
        maximus.Trainer(maximus.Config.from_dict(config(tiny, out, training={"max_steps": steps, "memory_meter": mode},
                                                        eval={"enabled": False}))).train()
        runs[mode] = (metrics_rows(out), json.loads((out / "run.json").read_text()))
    (every, every_info), (sampled, sampled_info) = runs["every_step"], runs["sampled"]
    assert [(r["reward"], r["loss"]) for r in sampled] == [(r["reward"], r["loss"]) for r in every]
    metered = [r["step"] for r in sampled if "peak_memory_bytes" in r]
    assert metered[:2] == [1, 2] and metered[-1] == steps and len(metered) < steps  # GRPO steps are no longer all metered
    by_step = {r["step"]: r["peak_memory_bytes"] for r in every}
    assert {r["step"]: r["peak_memory_bytes"] for r in sampled if r["step"] in metered} == {s: by_step[s] for s in metered}
    assert sampled_info["memory"]["peak_bytes"] == every_info["memory"]["peak_bytes"] == max(by_step.values())


def test_top_p_near_zero_samples_the_greedy_completion_and_generation_stops_at_eos(tiny, tmp_path):
    from maximus.train.trainer import Trainer

    trainer = Trainer(maximus.Config.from_dict(config(tiny, tmp_path / "run", grpo={"top_p": 1e-6,
                                                                                    "max_completion_tokens": 12})))
    trainer.setup()
    objective = trainer.objective
    batches = objective.step_batches(trainer.run_view, 1)
    assert [b["input_ids"].shape[0] for b in batches] == [2, 2, 2, 2]  # micro_batch_size counts completions
    gen = objective.generation
    prompts = trainer.rows_for_step(1)
    with objective._generating(trainer.model), torch.no_grad():
        greedy = objective._greedy(trainer.run_view, prompts)
    eos = trainer.tokenizer.eos_token_id
    for p, prompt in enumerate(prompts):
        n = len(prompt["prompt_ids"])
        for row in gen.rows[p * G:(p + 1) * G]:
            completion = row["input_ids"][n:]
            assert row["input_ids"][:n] == prompt["prompt_ids"] and completion == greedy[p]
            assert row["labels"] == [-100] * n + completion
            assert len(completion) <= 12 and (eos not in completion or completion.index(eos) == len(completion) - 1)
    assert gen.metrics["frac_reward_zero_std"] == 1.0 and float(gen.advantages.abs().max()) == 0.0


def test_the_loss_pass_scores_sampled_tokens_with_the_distribution_they_were_sampled_from(tiny, tmp_path):
    """On-policy: log p of each sampled completion token in the loss pass (train mode, padded
    micro-batches of several lengths, logits / temperature, through the chunked head) equals the
    log-softmax of the logits / temperature that the batched sampler drew it from (all prompts x
    group in one call: left-padded prompts, each prefilled once, its KV cache expanded to the
    group, finished rows dropped; eval mode)."""
    from maximus.train.objectives.grpo import completion_logps
    from maximus.train.trainer import Trainer

    T = 0.7
    trainer = Trainer(maximus.Config.from_dict(config(tiny, tmp_path / "run", grpo={"temperature": T,
                                                                                    "max_completion_tokens": 12},
                                                      training={"micro_batch_size": 4, "batch_size": 3})))
    trainer.setup()
    objective, model, eos = trainer.objective, trainer.model, trainer.tokenizer.eos_token_id
    torch.manual_seed(1)
    with torch.no_grad():  # a trained-looking adapter, so the policy is not the base
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
        model.get_output_embeddings().weight[eos] *= 25.0  # EOS now and then: completions of several lengths
    prompts = trainer.rows_for_step(1)
    assert len({len(p["prompt_ids"]) for p in prompts}) > 1  # left padding in the sampler
    with objective._generating(model), torch.no_grad():
        out = objective.sample(trainer.run_view, [p["prompt_ids"] for p in prompts], 0, record_logps=True)
    completions = out.completions
    sampled = [lp for group in out.logps for lp in group]
    assert out.forwards <= 1 + 11  # one prefill for all prompts x group, then one forward per token
    assert len({len(c) for group in completions for c in group}) > 1  # padded micro-batches below
    gen = objective.build_generation(trainer.run_view, 0, prompts, completions)
    assert model.training
    ours = []
    for start in range(0, len(gen.rows), objective.micro_batch_size):
        batch = objective._collate(gen, range(start, min(start + objective.micro_batch_size, len(gen.rows))))
        with torch.no_grad():
            logps, mask = completion_logps(model, batch, temperature=T, mode=objective.mode)
        ours.extend(logps[j][mask[j]] for j in range(logps.shape[0]))
    for a, b in zip(ours, sampled, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5)


def test_the_eos_that_ends_a_completion_carries_loss(tiny, tmp_path):
    """TRL's completion mask includes the EOS: the policy is taught when to stop."""
    from maximus.train.trainer import Trainer

    trainer = Trainer(maximus.Config.from_dict(config(tiny, tmp_path / "run")))
    trainer.setup()
    objective, eos = trainer.objective, trainer.tokenizer.eos_token_id
    prompts = trainer.rows_for_step(1)
    completions = [[[5, 6, eos], [7, eos], [8, 9, 10, 11, 12, 13], [eos]]] * len(prompts)
    gen = objective.build_generation(trainer.run_view, 0, prompts, completions)
    batch = objective._collate(gen, range(G))
    n = len(prompts[0]["prompt_ids"])
    labels = batch["labels"][:, n:]
    assert [[t for t in row.tolist() if t != -100] for row in labels] == completions[0]
    assert objective.g.loss_type == "dapo" and objective.count(batch) == 3 + 2 + 6 + 1  # dapo counts tokens
    assert gen.metrics["completion_length"] == (3 + 2 + 6 + 1) / 4 and gen.metrics["completions_truncated"] == 0.25


def test_non_finite_rewards_are_dropped_and_counted(tiny, tmp_path):
    out = tmp_path / "run"
    cfg = config(tiny, out, grpo={"rewards": [f"{REWARDS}:nan_every_other"]}, training={"max_steps": 1},
                 eval={"enabled": False})
    maximus.Trainer(maximus.Config.from_dict(cfg)).train()
    row = metrics_rows(out)[0]
    assert row["rewards_dropped"] == 2 * 3  # per prompt: nan, inf, nan of 4 completions
    assert row["reward"] == 1.0 and row["reward_std"] == 0.0


def test_chat_prompts_reach_the_rewards_as_messages_with_their_columns(tiny, tmp_path):
    out = tmp_path / "run"
    cfg = config(tiny, out, grpo={"rewards": [f"{REWARDS}:chat_shapes"]}, training={"max_steps": 1})
    cfg["dataset"]["path"] = str(tiny["chat"])
    summary = maximus.Trainer(maximus.Config.from_dict(cfg)).train()
    assert metrics_rows(out)[0]["reward"] == 1.0 and summary["eval"]["after"]["reward"] == 1.0


# ------------------------------------------------------------------------------ rewards and errors
def test_builtin_rewards_read_their_keys_from_the_config():
    from maximus.train.rewards import load_rewards

    cfg = maximus.Config.from_dict({"model": "m", "dataset": "d", "objective": "grpo",
                                    "grpo": {"rewards": ["exact_answer", "regex_format", "exact_answer"],
                                             "answer_field": "solution", "format_pattern": r"<a>\d+</a>"}})
    exact, regex, again = load_rewards(cfg)
    assert (exact.name, regex.name, again.name) == ("exact_answer", "regex_format", "exact_answer_2")
    assert exact.fn(["p"], ["42"], solution=["42"], answer=["41"]) == [1.0]
    assert regex.fn(["p"] * 2, ["<a>7</a>", "<b>7</b>"]) == [1.0, 0.0]


def test_builtin_rewards():
    assert normalise_answer("  Gold\u00a0 BLUE\tred \n") == "gold blue red"
    assert exact_answer(["p"] * 3, [" gold blue red", "gold red blue", [{"role": "assistant", "content": "GOLD blue red"}]],
                        answer=["gold blue red"] * 3) == [1.0, 0.0, 1.0]
    assert exact_answer(["p"], ["x"], solution=["x"], answer_field="solution") == [1.0]
    assert exact_answer(["p"], ["x"]) == [None]
    assert regex_format(["p"] * 2, ["<a>1</a>", "<a>1</a> extra"], pattern=r"<a>\d+</a>") == [1.0, 0.0]


@pytest.mark.parametrize("reward,message", [
    ("boom", r"^reward function .*grpo_test_rewards.py:boom raised ValueError: cannot score this on prompt 0 of step 1 "
             r"\(.*prompts.jsonl:\d+\) \(hint: fix the function; it is called as f\(prompts, completions, completion_ids, "
             r"\*\*columns\) -> one float or None per completion\)$"),
    ("one_value", r"^reward function .*:one_value returned 1 values for 4 completions on prompt 0 of step 1"),
    ("text_value", r"^reward function .*:text_value returned str 'high' for completion 0 on prompt 0 of step 1"),
])
def test_a_failing_reward_function_is_one_line_naming_it_and_the_prompt(tiny, tmp_path, reward, message):
    cfg = config(tiny, tmp_path / "run", grpo={"rewards": [f"{REWARDS}:{reward}"]}, eval={"before": False})
    with pytest.raises(RewardError, match=message):
        maximus.Trainer(maximus.Config.from_dict(cfg)).train()


@pytest.mark.parametrize("grpo,message", [
    ({"rewards": []}, r"^objective grpo needs at least one reward function in grpo.rewards"),
    ({"rewards": ["exact"]}, r"^grpo.rewards: 'exact' is neither a built-in nor module:function"),
    ({"rewards": ["missing_dir/r.py:f"]}, r"^grpo.rewards: reward file not found: missing_dir/r.py"),
    ({"rewards": ["no_such_module_h21:f"]}, r"^grpo.rewards: cannot import 'no_such_module_h21': ModuleNotFoundError"),
    ({"rewards": [f"{REWARDS}:nope"]}, r"^grpo.rewards: .*grpo_test_rewards.py has no function 'nope'"),
    ({"rewards": ["regex_format"]}, r"^the built-in reward regex_format needs grpo.format_pattern"),
    ({"rewards": ["regex_format"], "format_pattern": "(["}, r"^grpo.format_pattern is not a valid regular expression"),
    ({"rewards": ["exact_answer"], "reward_weights": [1.0, 2.0]},
     r"^grpo.reward_weights has 2 weights for 1 reward functions"),
])
def test_reward_configuration_errors(tiny, tmp_path, grpo, message):
    with pytest.raises(ConfigError, match=message):
        maximus.Trainer(maximus.Config.from_dict(config(tiny, tmp_path / "run", grpo=grpo))).train()
    assert not (tmp_path / "run").exists()  # nothing written before the config holds


def test_a_reference_needs_an_adapter_and_approximate_losses_are_refused(tiny, tmp_path):
    cfg = config(tiny, tmp_path / "full", grpo={"beta": 0.1}, method="full")
    with pytest.raises(ConfigError, match=r"^grpo.beta > 0 compares with the model with its adapter switched off, "
                                          r"but method is full \(hint: use method: lora or qlora, or set grpo.beta: 0"):
        maximus.Trainer(maximus.Config.from_dict(cfg)).train()
    cfg = config(tiny, tmp_path / "ghost", optimization={"use_ghost_logit": True, "gradient_checkpointing": "off"})
    with pytest.raises(ConfigError, match=r"use_ghost_logit does not apply to objective grpo"):
        maximus.Trainer(maximus.Config.from_dict(cfg)).train()


# ------------------------------------------------------------------------------ sampling at speed
def _soft_capped_dir(path: Path, softcap: float = 4.0) -> Path:
    """A tiny Gemma-3 text model with Gemma-2-style final logit soft-capping."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from maximus.data.tiny_tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer(vocab_size=300)
    config = Gemma3TextConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                          final_logit_softcapping=softcap, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                          bos_token_id=None, sliding_window=256)
    torch.manual_seed(0)
    Gemma3ForCausalLM(config).save_pretrained(str(path), safe_serialization=True)
    tok.save_pretrained(str(path))
    return path


def test_a_soft_capped_model_samples_and_scores_at_a_temperature(tiny, tmp_path):
    """Soft-capped logits (Gemma's final_logit_softcapping) at temperature 0.7: z = softcap(y) / T both when sampling
    and in the loss pass (per-token log-probs agree); refused before."""
    from maximus.train.objectives.grpo import completion_logps
    from maximus.train.trainer import Trainer

    T = 0.7
    cfg = config(tiny, tmp_path / "run", grpo={"temperature": T, "max_completion_tokens": 8})
    cfg["model"] = str(_soft_capped_dir(tmp_path / "gemma"))
    trainer = Trainer(maximus.Config.from_dict(cfg))
    trainer.setup()
    objective, model = trainer.objective, trainer.model
    objective.prepare(trainer.run_view)
    prompts = trainer.rows_for_step(1)
    with objective._generating(model), torch.no_grad():
        out = objective.sample(trainer.run_view, [p["prompt_ids"] for p in prompts], 0, record_logps=True)
    gen = objective.build_generation(trainer.run_view, 0, prompts, out.completions)
    batch = objective._collate(gen, range(len(gen.rows)))
    with torch.no_grad():
        logps, mask = completion_logps(model, batch, temperature=T, mode=objective.mode)
    ours = [logps[j][mask[j]] for j in range(logps.shape[0])]
    for a, b in zip(ours, [lp for group in out.logps for lp in group], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5)


def test_eval_generations_of_chat_prompts_go_through_the_chat_template(tiny, tmp_path):
    from maximus.evaluate import generate_text
    from maximus.train.trainer import Trainer

    cfg = config(tiny, tmp_path / "run", grpo={"rewards": [f"{REWARDS}:chat_shapes"]},
                 eval={"prompts": ["Reverse: red gold blue\nAnswer:"], "max_new_tokens": 6})
    cfg["dataset"]["path"] = str(tiny["chat"])
    trainer = Trainer(maximus.Config.from_dict(cfg))
    trainer.setup()
    result = trainer.objective.evaluate(trainer.run_view)
    kwargs = dict(device=trainer.device, max_new_tokens=6)
    templated = generate_text(trainer.model, trainer.tokenizer, cfg["eval"]["prompts"], chat=True, **kwargs)
    raw = generate_text(trainer.model, trainer.tokenizer, cfg["eval"]["prompts"], chat=False, **kwargs)
    assert templated != raw and result["generations"] == templated


def test_steps_per_generation_splits_one_generation_batch_over_several_steps(tiny, tmp_path):
    out = tmp_path / "run"
    cfg = config(tiny, out, grpo={"steps_per_generation": 2}, training={"max_steps": 4, "micro_batch_size": 4},
                 eval={"enabled": False})
    trainer = maximus.Trainer(maximus.Config.from_dict(cfg))
    trainer.train()
    rows = metrics_rows(out)
    assert ["generation_s" in r for r in rows] == [True, False, True, False]
    assert rows[1]["reward"] == rows[0]["reward"] != rows[2]["reward"]
    assert rows[0]["clip_ratio"] == 0.0  # the first share is on-policy: ratio 1
    gen, objective = trainer.objective.generation, trainer.objective
    assert gen.old_logps is not None and len(gen.rows) == 2 * G
    shares = [objective.step_batches(trainer.run_view, step) for step in (3, 4)]
    assert [sum(b["input_ids"].shape[0] for b in batches) for batches in shares] == [G, G]
    assert torch.equal(shares[0][0]["advantages"], gen.advantages[:G])
    assert torch.equal(shares[1][0]["advantages"], gen.advantages[G:])


def test_the_kept_old_log_probs_drawn_by_the_sampler_equal_the_separate_pass(tiny, tmp_path):
    """In float32 the sampling policy's log-probs kept for the clipped ratio are the sampler's
    own (no extra pass): equal, position by position, to the no-grad pass over the rows that
    bf16 / fp16 runs keep using, and to zero off the completion tokens."""
    from maximus.memory.generation import sampler_records_logps
    from maximus.memory.spec_from_config import grpo_settings
    from maximus.train.trainer import Trainer

    cfg = maximus.Config.from_dict(config(tiny, tmp_path / "run", grpo={"steps_per_generation": 2, "temperature": 0.7,
                                                                        "max_completion_tokens": 12},
                                          training={"batch_size": 3, "micro_batch_size": 3}))
    trainer = Trainer(cfg)
    trainer.setup()
    objective, model = trainer.objective, trainer.model
    g = grpo_settings(cfg)
    assert sampler_records_logps(g, "fp32") and not sampler_records_logps(g, "bf16")
    assert not sampler_records_logps(grpo_settings(maximus.Config.from_dict(config(tiny, tmp_path / "b"))), "fp32")  # on-policy: none kept
    torch.manual_seed(2)
    with torch.no_grad():  # a trained-looking adapter, and EOS now and then: rows of several lengths
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
        model.get_output_embeddings().weight[trainer.tokenizer.eos_token_id] *= 25.0
    gen = objective._generate(trainer.run_view, 0)
    assert len({len(r["input_ids"]) for r in gen.rows}) > 1
    passed = objective._logps_of_rows(trainer.run_view, gen)
    for row, drawn, scored in zip(gen.rows, gen.old_logps, passed, strict=True):
        assert drawn.shape == scored.shape == (len(row["input_ids"]),)
        labelled = torch.tensor([label != -100 for label in row["labels"][1:]] + [False])
        assert torch.equal(drawn[~labelled], torch.zeros(int((~labelled).sum())))
        torch.testing.assert_close(drawn, scored, rtol=0, atol=2e-5)


def test_sampling_with_lora_merged_into_float32_weights_equals_the_unmerged_sampler(tiny, tmp_path):
    """With room for the copy, float32 LoRA samples with W + s B A formed once per generation
    (`merged_for_sampling`): the same completions and log-probs (to float32 rounding) as the
    unmerged sampler; calls with gradients inside the block, and every call after it, take the
    unmerged path bit for bit."""
    from maximus.kernels.lean_lora import merged_for_sampling
    from maximus.train.trainer import Trainer

    trainer = Trainer(maximus.Config.from_dict(config(tiny, tmp_path / "run", grpo={"max_completion_tokens": 12},
                                                      training={"batch_size": 3, "micro_batch_size": 3})))
    trainer.setup()
    objective, model = trainer.objective, trainer.model
    assert trainer.plan.generation["merge_lora"]
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
        model.get_output_embeddings().weight[trainer.tokenizer.eos_token_id] *= 25.0
    prompts = [p["prompt_ids"] for p in trainer.rows_for_step(1)]
    runs = []
    for merge in (True, False):
        objective.plan.generation["merge_lora"] = merge
        with objective._generating(model), torch.no_grad():
            runs.append(objective.sample(trainer.run_view, prompts, 0, record_logps=True))
    merged, plain = runs
    assert merged.completions == plain.completions
    for a, b in zip(merged.logps, plain.logps, strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-5)
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
    with merged_for_sampling(model) as count:
        assert count == sum(hasattr(m, "lora_A") for m in model.modules()) > 0  # every adapted projection
        with torch.no_grad():
            inside = model(input_ids=ids).logits
        with_grad = model(input_ids=ids).logits.detach()
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert torch.equal(before, after) and torch.equal(before, with_grad) and not torch.equal(before, inside)
    torch.testing.assert_close(inside, before, rtol=0, atol=1e-5)


def test_a_steps_per_generation_that_does_not_divide_the_generation_batch_is_one_line(tiny, tmp_path):
    cfg = config(tiny, tmp_path / "run", grpo={"steps_per_generation": 3})
    with pytest.raises(ConfigError, match=r"^config: grpo.steps_per_generation 3 does not divide the generation batch "
                                          r"of 8 completions \(training.batch_size 2 x grpo.group_size 4\) \(hint: use "
                                          r"a divisor of 8 \(2, 4, 8, \.\.\.\) or change training.batch_size\)$"):
        maximus.Config.from_dict(cfg)


def test_async_generation_samples_the_next_batch_with_the_weights_before_the_update(tiny, tmp_path):
    """While step 1 runs its backward, generation 1 is sampled on a second thread with the weights
    before step 1's update; its kept log-probs are that policy's, so step 2 (one step
    off-policy) is corrected by the clipped ratio."""
    from maximus.train.trainer import Trainer

    trainer = Trainer(maximus.Config.from_dict(config(tiny, tmp_path / "run", grpo={"async_generation": True},
                                                      training={"max_steps": 3})))
    trainer.setup()
    objective, model = trainer.objective, trainer.model
    before = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
    trainer.train_step(1)
    pending = objective._pending
    assert pending is not None and pending.index == 1
    after = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
    assert any(not torch.equal(before[k], after[k]) for k in before)
    with torch.no_grad():  # reproduce generation 1 with the weights before step 1's update
        for k, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(before[k])
        prompts = trainer.rows_for_step(2)
        sampled = objective.sample(trainer.run_view, [p["prompt_ids"] for p in prompts], 1, record_logps=True)
        expected = sampled.completions
        old = objective.build_generation(trainer.run_view, 1, prompts, expected, sampled_logps=sampled.logps).old_logps
        for k, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(after[k])
    gen = pending.take()
    assert [r["input_ids"] for r in gen.rows] == [p["prompt_ids"] + c for p, group in zip(prompts, expected) for c in group]
    for a, b in zip(gen.old_logps, old, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    objective._pending = pending
    result = trainer.train_step(2)
    assert objective.generation.index == 1 and result["metrics"]["clip_ratio"] >= 0


def test_vllm_generation_without_cuda_is_one_line_before_the_model_loads(tiny, tmp_path):
    cfg = config(tiny, tmp_path / "run", grpo={"generation": "vllm"})
    with pytest.raises(ConfigError, match=r"^grpo.generation: vllm needs a CUDA GPU, but this run is on cpu \(hint: "
                                          r"set grpo.generation: batched"):
        maximus.Trainer(maximus.Config.from_dict(cfg)).train()
    assert not (tmp_path / "run").exists()
