"""The GRPO objective (`objective: grpo`): reinforcement learning from reward functions.

Every `grpo.updates_per_generation` optimizer steps, one *generation*:

1. the step's `training.batch_size` prompt rows (`maximus.data.prompts`) are each sampled
   `grpo.group_size` times from the policy (the adapter on) with the KV cache, one batch per
   group (the group shares its prompt, so no padding), stopping at EOS or after
   `max_completion_tokens`; sampling is seeded by (seed, generation, prompt), so a redone or
   resumed step sees the same completions;
2. the reward functions score each group (`maximus.train.rewards`), and each completion's
   advantage is its reward relative to its group (`maximus.losses.grpo.group_advantages`);
3. with `beta > 0`, the reference log-probs: the same model with the adapter switched off
   (`disable_adapter()`, no second copy), in `no_grad`; with `updates_per_generation > 1`, the
   sampling policy's log-probs, kept for the clipped ratio of every later update (with one update
   the policy *is* the sampling policy: ratio 1, no extra pass, as in TRL).

Each optimizer step then runs the completions in micro-batches of `training.micro_batch_size`
completions (default: one group) through the loss (`grpo_loss_sum`): per-token log-probs of the
completion tokens only (prompt and padding labels are -100), through the chunked head
(`token_log_probs`), so no completions x vocabulary logits tensor ever exists. Log-probs are taken
at the sampling temperature (logits / temperature), as TRL does.

Metrics per step (metrics.jsonl): `reward`, `reward_std`, `reward/<function>`, `rewards_dropped`
(non-finite rewards), `frac_reward_zero_std` (groups that teach nothing), `completion_length`,
`completions_truncated` (no EOS within max_completion_tokens), `kl` (with beta > 0),
`clip_ratio` (+ `/low`, `/high`), `generation_s`, `generation_tokens_per_s`; the trainer adds
loss, tokens_per_s and memory. `evaluate`: greedy completions of the held-out prompts, their mean
reward and per-function means (the before/after table).

Raises ConfigError: `optimization.use_ghost_logit` or `matryoshka`; `beta > 0` without an adapter
to switch off; temperature != 1 on a soft-capped head; more than one process; reward loading
errors. RewardError: a reward function raising or returning the wrong thing (one line, naming it).
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from maximus.errors import ConfigError
from maximus.losses.grpo import group_advantages, grpo_loss_sum
from maximus.losses.linear_cross_entropy import linear_cross_entropy, naive_cross_entropy, token_log_probs
from maximus.memory.plan import Plan
from maximus.forward import IGNORE_INDEX, autocast_for, hidden_states, output_head, shift_labels, through_head
from maximus.structure import peft_model_of
from maximus.train.objectives.base import Objective
from maximus.train.rewards import load_rewards, score_group

#: Metrics summed over a step's micro-batches, then divided by its completion tokens.
_TOKEN_SUMS = ("tokens", "kl_sum", "clipped_low_sum", "clipped_high_sum")


def completion_logps(model, batch: dict, *, temperature: float = 1.0, chunk_size: int | None = None,
                     mode: str = "exact") -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token log p of each labelled token [B, T] float32, mask [B, T] bool) at `temperature`.

    Position t holds log p(input[t + 1] | input[:t + 1]) where that token is labelled (a
    completion token), else 0. `mode` ``exact`` is chunked (no full logits); ``naive`` holds the
    full logits (the reference path, `optimization.loss: naive`)."""
    position_ids = batch.get("position_ids")
    hidden = hidden_states(model, batch["input_ids"], position_ids)
    target = shift_labels(batch["labels"], position_ids)

    def logps_of(hidden: torch.Tensor) -> torch.Tensor:
        head = output_head(model)  # read inside: a sharded head is gathered only here
        scale = 1.0 / temperature
        h = hidden * scale if scale != 1.0 else hidden
        bias = head.bias * scale if head.bias is not None and scale != 1.0 else head.bias
        if mode == "naive":
            return -naive_cross_entropy(h, head.weight, target, IGNORE_INDEX, softcap=head.softcap,
                                        reduction="none", bias=bias)
        if head.softcap is not None:  # temperature 1 only (GRPOObjective.prepare refuses the rest)
            return -linear_cross_entropy(h, head.weight, target, IGNORE_INDEX, chunk_size=chunk_size,
                                         softcap=head.softcap, reduction="none", bias=bias)
        return token_log_probs(h, head.weight, target, IGNORE_INDEX, chunk_size=chunk_size, bias=bias)

    return through_head(model, hidden, logps_of), target != IGNORE_INDEX


@dataclass
class Generation:
    """One generation's completions, ready for `updates_per_generation` optimizer steps.

    `rows[i]`: input_ids / labels / position_ids of prompt + completion i (labels on the
    completion only); `old_logps[i]` / `ref_logps[i]`: float32 [len(row)] aligned like
    `completion_logps` (None when not needed); `advantages` [N]."""

    index: int
    rows: list[dict]
    advantages: torch.Tensor
    old_logps: list[torch.Tensor] | None
    ref_logps: list[torch.Tensor] | None
    metrics: dict = field(default_factory=dict)


class GRPOObjective(Objective):
    """GRPO / Dr. GRPO / DAPO on sampled completions (module doc). Protocol as
    `maximus.train.objectives.base.SFTObjective`, plus `step_batches` (generation) and `step_metrics`."""

    name = "grpo"

    def __init__(self, cfg, plan: Plan, pad_token_id: int):
        super().__init__(cfg, plan, pad_token_id)
        self.refuse_ghost_logit("GRPO's log-probs are exact and chunked already")
        if cfg.optimization.matryoshka is not None:
            raise ConfigError("optimization.matryoshka does not apply to objective grpo",
                              "remove optimization.matryoshka (it is an SFT auxiliary loss)")
        self.g = cfg.grpo
        self.rewards = load_rewards(cfg)
        self.generation: Generation | None = None
        self._sums: dict[str, float] = {}

    @property
    def mode(self) -> str:
        """The log-prob pass: ``naive`` (full logits) when the plan says so, else ``exact``."""
        return "naive" if self.plan.loss_mode == "naive" else "exact"

    # ------------------------------------------------------------------------------ protocol
    @property
    def micro_batch_size(self) -> int:
        """Completions per forward/backward: the plan's (`training.micro_batch_size`, or what the
        planner chose for `target_vram` / the free memory); read each step, so a re-plan after an
        out-of-memory error applies to the redone step."""
        return max(1, self.plan.micro_batch_size)

    def prepare(self, trainer) -> None:
        if getattr(trainer.dist, "world_size", 1) > 1:
            raise ConfigError("objective grpo runs in one process for now, not under torchrun",
                              "run maximus-train without torchrun")
        if self.g.beta > 0 and peft_model_of(trainer.model) is None:
            raise ConfigError(f"grpo.beta > 0 compares with the model with its adapter switched off, but method is "
                              f"{trainer.method}", "use method: lora or qlora, or set grpo.beta: 0 (no reference)")
        if self.g.temperature != 1.0 and output_head(trainer.model).softcap is not None:
            raise ConfigError(f"grpo.temperature {self.g.temperature} on a model with soft-capped logits: the "
                              "log-probs at that temperature are not computed", "set grpo.temperature: 1.0")

    def count(self, batch: dict) -> int:
        if self.g.loss_type == "dapo":
            return int((shift_labels(batch["labels"], batch.get("position_ids")) != IGNORE_INDEX).sum())
        return int(batch["input_ids"].shape[0])

    def tokens(self, batch: dict) -> int:
        return int(batch["lengths"].sum())

    def step_batches(self, trainer, step: int) -> list[dict]:
        """The micro-batches of optimizer step `step`: one generation serves
        `updates_per_generation` consecutive steps (generated on the first of them)."""
        index = (step - 1) // self.g.updates_per_generation
        if self.generation is None or self.generation.index != index:
            self.generation = None  # free the last one before sampling the next
            self.generation = self._generate(trainer, index)
        self._sums = {k: 0.0 for k in _TOKEN_SUMS}
        self._sampled_now = (step - 1) % self.g.updates_per_generation == 0
        gen = self.generation
        micro = self.micro_batch_size
        return [self._collate(gen, range(i, min(i + micro, len(gen.rows)))) for i in range(0, len(gen.rows), micro)]

    def loss_sum(self, model, batch: dict) -> tuple[torch.Tensor, dict]:
        logps, mask = completion_logps(model, batch, temperature=self.g.temperature,
                                       chunk_size=self.plan.loss_chunk_size, mode=self.mode)
        parts = grpo_loss_sum(logps, mask, batch["advantages"], old_logps=batch.get("old_logps"),
                              ref_logps=batch.get("ref_logps"), beta=self.g.beta, epsilon=self.g.epsilon,
                              epsilon_high=self.g.epsilon_high, loss_type=self.g.loss_type,
                              max_completion_tokens=self.g.max_completion_tokens,
                              kl_ratio_correction=self.g.kl_ratio_correction)
        for k in _TOKEN_SUMS:
            self._sums[k] = self._sums.get(k, 0.0) + float(getattr(parts, k))
        return parts.loss_sum, {}

    def step_metrics(self) -> dict:
        """This step's generation metrics and its token means (kl, clip ratios)."""
        tokens = max(self._sums.get("tokens", 0.0), 1.0)
        out = dict(self.generation.metrics) if self.generation is not None else {}
        if not getattr(self, "_sampled_now", True):  # a later update on the same completions
            out.pop("generation_s", None)
            out.pop("generation_tokens_per_s", None)
        low, high = self._sums.get("clipped_low_sum", 0.0) / tokens, self._sums.get("clipped_high_sum", 0.0) / tokens
        out.update({"clip_ratio": low + high, "clip_ratio/low": low, "clip_ratio/high": high})
        if self.g.beta > 0:
            out["kl"] = self._sums.get("kl_sum", 0.0) / tokens
        return out

    @torch.no_grad()
    def evaluate(self, trainer) -> dict:
        """Greedy completions of the held-out prompts: mean reward, per-function means, lengths."""
        rows = trainer.data.eval
        if self.cfg.eval.max_batches is not None:
            rows = rows[:self.cfg.eval.max_batches * self.micro_batch_size]
        if not rows:
            return {}
        totals, per_function, lengths = [], [], []
        with self._generating(trainer.model):
            for start in range(0, len(rows), self.micro_batch_size):
                chunk = rows[start:start + self.micro_batch_size]
                completions = self._greedy(trainer, chunk)
                for j, (row, ids) in enumerate(zip(chunk, completions)):
                    scores = self._score(trainer, row, [ids], where=f"held-out prompt {start + j} ({row['where']})")
                    totals.append(scores.total)
                    per_function.append(scores.per_function)
                    lengths.append(len(ids))
        total, per_function = torch.cat(totals), torch.cat(per_function)
        result = {"reward": _nanmean(total), "completion_length": sum(lengths) / len(lengths), "prompts": len(rows)}
        for k, function in enumerate(self.rewards):
            result[f"reward/{function.name}"] = _nanmean(per_function[:, k])
        if self.cfg.eval.prompts:
            from maximus.evaluate import generate_text

            result["generations"] = generate_text(trainer.model, trainer.tokenizer, self.cfg.eval.prompts,
                                                  device=trainer.device, max_new_tokens=self.cfg.eval.max_new_tokens)
        return result

    # ------------------------------------------------------------------------------ generation
    @contextmanager
    def _generating(self, model):
        """Eval mode (no dropout; checkpointed layers run plainly) for sampling, then back."""
        was_training = model.training
        model.eval()
        try:
            yield
        finally:
            model.train(was_training)

    def _generate(self, trainer, index: int) -> Generation:

        prompts = trainer.rows_for_step(index + 1)
        started = time.perf_counter()
        with self._generating(trainer.model), torch.no_grad(), autocast_for(trainer.device, trainer.dtype):
            completions = [self._sample(trainer, prompt["prompt_ids"], seed=(self.cfg.training.seed, index, p))
                           for p, prompt in enumerate(prompts)]
        generation_s = time.perf_counter() - started
        gen = self.build_generation(trainer, index, prompts, completions)
        tokens = sum(len(c) for group in completions for c in group)
        gen.metrics.update(generation_s=generation_s, generation_tokens_per_s=tokens / max(generation_s, 1e-9))
        return gen

    def build_generation(self, trainer, index: int, prompts: list[dict], completions: list[list[list[int]]]) -> Generation:
        """Score the sampled `completions[p][i]` (token ids, cut after EOS) of each prompt row,
        and take the reference / sampling-policy log-probs the updates need (module doc)."""
        g, eos = self.g, trainer.tokenizer.eos_token_id
        rows, totals, per_function, truncated, dropped = [], [], [], 0, 0
        step = index * g.updates_per_generation + 1
        for p, (prompt, ids) in enumerate(zip(prompts, completions)):
            truncated += sum(eos not in c for c in ids)
            scores = self._score(trainer, prompt, ids, where=f"prompt {p} of step {step} ({prompt['where']})")
            totals.append(scores.total)
            per_function.append(scores.per_function)
            dropped += scores.dropped
            P = prompt["prompt_ids"]
            rows.extend({"input_ids": P + c, "labels": [IGNORE_INDEX] * len(P) + c,
                         "position_ids": list(range(len(P) + len(c)))} for c in ids)
        total, per_function = torch.cat(totals), torch.cat(per_function)
        advantages = group_advantages(total, g.group_size, g.scale_rewards).float()
        lengths = [sum(l != IGNORE_INDEX for l in r["labels"]) for r in rows]
        zero_std = [not _nanstd(x) for x in total.reshape(-1, g.group_size)]
        metrics = {"reward": _nanmean(total), "reward_std": _nanstd(total), "rewards_dropped": dropped,
                   "frac_reward_zero_std": sum(zero_std) / len(zero_std),
                   "completion_length": sum(lengths) / len(lengths), "completions_truncated": truncated / len(rows)}
        for k, function in enumerate(self.rewards):
            metrics[f"reward/{function.name}"] = _nanmean(per_function[:, k])
        gen = Generation(index, rows, advantages, None, None, metrics)
        if g.beta > 0:
            with peft_model_of(trainer.model).disable_adapter():
                gen.ref_logps = self._logps_of_rows(trainer, gen)
        if g.updates_per_generation > 1:
            gen.old_logps = self._logps_of_rows(trainer, gen)
        return gen

    def sampling_config(self, eos_token_id: int, **extra):
        """The `GenerationConfig` of the policy's sampling (`extra`: e.g. `output_logits=True`)."""
        from transformers import GenerationConfig

        g = self.g
        return GenerationConfig(do_sample=True, temperature=g.temperature, top_p=g.top_p, top_k=0,
                                max_new_tokens=g.max_completion_tokens, eos_token_id=eos_token_id,
                                pad_token_id=self.pad_token_id, num_beams=1, use_cache=True, **extra)

    def _sample(self, trainer, prompt_ids: list[int], seed: tuple) -> list[list[int]]:
        """`group_size` sampled completions of one prompt, each cut after its first EOS (kept)."""
        g, tok, device = self.g, trainer.tokenizer, trainer.device
        config = self.sampling_config(tok.eos_token_id)
        prompt = torch.tensor([prompt_ids], device=device).repeat(g.group_size, 1)
        devices = [device.index or 0] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(hash(seed) % 2**63)
            out = trainer.model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                         generation_config=config)
        return [_cut_at_eos(row, tok.eos_token_id) for row in out[:, len(prompt_ids):].tolist()]

    def _greedy(self, trainer, rows: list[dict]) -> list[list[int]]:
        """One greedy completion per prompt row, batched with left padding."""
        from transformers import GenerationConfig

        tok, device = trainer.tokenizer, trainer.device
        width = max(len(r["prompt_ids"]) for r in rows)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r["prompt_ids"]):] = torch.tensor(r["prompt_ids"])
            mask[i, width - len(r["prompt_ids"]):] = 1
        config = GenerationConfig(do_sample=False, max_new_tokens=self.g.max_completion_tokens, num_beams=1,
                                  eos_token_id=tok.eos_token_id, pad_token_id=self.pad_token_id, use_cache=True)
        out = trainer.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                     generation_config=config)
        return [_cut_at_eos(row, tok.eos_token_id) for row in out[:, width:].tolist()]

    def _score(self, trainer, row: dict, completion_ids: list[list[int]], *, where: str):
        tok = trainer.tokenizer
        texts = [tok.decode([t for t in c if t != tok.eos_token_id], skip_special_tokens=True) for c in completion_ids]
        chat = isinstance(row["prompt"], list)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if chat else texts
        n = len(completion_ids)
        columns = {k: [v] * n for k, v in row["columns"].items()}
        return score_group(self.rewards, self.g.reward_weights, [row["prompt"]] * n, completions,
                           completion_ids, columns, where=where)

    def _logps_of_rows(self, trainer, gen: Generation) -> list[torch.Tensor]:
        """Per-row token log-probs (no_grad) of the model as it is now, micro-batch by micro-batch."""

        out = []
        micro = self.micro_batch_size
        with torch.no_grad():
            for i in range(0, len(gen.rows), micro):
                batch = self._collate(gen, range(i, min(i + micro, len(gen.rows))), with_logps=False)
                batch = {k: v.to(trainer.device) for k, v in batch.items()}
                with autocast_for(trainer.device, trainer.dtype):
                    logps, _ = completion_logps(trainer.model, batch, temperature=self.g.temperature,
                                                chunk_size=self.plan.loss_chunk_size, mode=self.mode)
                out.extend(logps[j, :int(n)].float().cpu() for j, n in enumerate(batch["lengths"]))
        return out

    def _collate(self, gen: Generation, indices, with_logps: bool = True) -> dict:
        from maximus.data import collate

        indices = list(indices)
        batch = collate([gen.rows[i] for i in indices], self.pad_token_id)
        batch["advantages"] = gen.advantages[indices]
        batch["lengths"] = torch.tensor([len(gen.rows[i]["input_ids"]) for i in indices])
        width = batch["input_ids"].shape[1]
        for name in ("old_logps", "ref_logps"):
            values = getattr(gen, name)
            if with_logps and values is not None:
                padded = torch.zeros(len(indices), width)
                for j, i in enumerate(indices):
                    padded[j, :len(values[i])] = values[i]
                batch[name] = padded
        return batch


def _cut_at_eos(ids: list[int], eos: int) -> list[int]:
    return ids[:ids.index(eos) + 1] if eos in ids else ids


def _nanmean(x: torch.Tensor) -> float | None:
    valid = x[~torch.isnan(x)]
    return float(valid.mean()) if valid.numel() else None


def _nanstd(x: torch.Tensor) -> float | None:
    valid = x[~torch.isnan(x)]
    return float(valid.std()) if valid.numel() > 1 else (0.0 if valid.numel() else None)
