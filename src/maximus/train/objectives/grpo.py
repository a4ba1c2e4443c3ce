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

Under torchrun with `training.context_parallel` equal to the number of processes, the training
pass is split: every rank samples the generation batch whole (generation, rewards and the
reference / sampling-policy log-probs are not split) and keeps the group's first rank's
completions, then each micro-batch of completions is cut into the ranks' zigzag shares
(`ContextParallel.share_rows`), with the kept log-probs cut alike; each rank's loss is the sum of
its tokens' terms (a ``grpo`` token divided by its whole completion's length), and the ranks' sums
make the one-process loss.

Raises ConfigError: `optimization.use_ghost_logit` or `matryoshka`; `beta > 0` without an adapter
to switch off; temperature != 1 on a soft-capped head; torchrun without a context-parallel group
of the whole world, or under FSDP2; reward loading errors. RewardError: a reward function raising or returning the wrong thing (one line, naming it).
"""
from __future__ import annotations

import time
import threading
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from maximus.errors import ConfigError
from maximus.losses.grpo import group_advantages, grpo_loss_sum
from maximus.losses.token_outputs import label_log_probs
from maximus.memory.generation import sampler_records_logps
from maximus.memory.spec_from_config import grpo_settings
from maximus.memory.plan import Plan
from maximus.train.views import LivePlan, RunView
from maximus.forward import IGNORE_INDEX, autocast_for, batch_target, hidden_states, output_head, through_head
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
    hidden = hidden_states(model, batch["input_ids"], batch.get("position_ids"))
    target = batch_target(batch)  # a context-parallel share carries its targets shifted on the whole row

    def logps_of(hidden: torch.Tensor) -> torch.Tensor:
        head = output_head(model)  # read inside: a sharded head is gathered only here
        return label_log_probs(hidden, head.weight, target, bias=head.bias, softcap=head.softcap,
                               temperature=temperature, ignore_index=IGNORE_INDEX, chunk_size=chunk_size, mode=mode)

    return through_head(model, hidden, logps_of), target != IGNORE_INDEX


def check_world(world_size: int, context_parallel: int, strategy: str) -> None:
    """GRPO under torchrun: only the rows of the training pass are split (every rank of one
    context-parallel group of the whole world), under DDP; a ConfigError otherwise."""
    if world_size > 1 and context_parallel != world_size:
        raise ConfigError(f"objective grpo under torchrun splits rows only: training.context_parallel "
                          f"({context_parallel}) must equal the number of processes ({world_size})",
                          f"set training.context_parallel: {world_size}, or run maximus-train without torchrun")
    if world_size > 1 and strategy == "fsdp":
        raise ConfigError(f"objective grpo under training.context_parallel {context_parallel} runs under DDP, not "
                          "FSDP2: every rank samples whole completions outside the training step",
                          "set training.distributed: ddp")


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

    def __init__(self, cfg, plan: Plan | LivePlan, pad_token_id: int):
        super().__init__(cfg, plan, pad_token_id)
        self.refuse_ghost_logit("GRPO's log-probs are exact and chunked already")
        if cfg.optimization.matryoshka is not None:
            raise ConfigError("optimization.matryoshka does not apply to objective grpo",
                              "remove optimization.matryoshka (it is an SFT auxiliary loss)")
        self.g = cfg.grpo
        self.rewards = load_rewards(cfg)
        self.generation: Generation | None = None
        self._pending: "_PendingGeneration | None" = None
        self._vllm = None  # grpo.generation: vllm, started on the first generation
        self._sums: dict[str, float] = {}
        #: The trainer's `ContextParallel` (training.context_parallel): the training pass's rows are
        #: split over its ranks; None or degree 1: whole rows.
        self.context_parallel = None

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

    @property
    def split(self):
        """The context-parallel group when rows are split, else None."""
        cp = self.context_parallel
        return cp if cp is not None and cp.split.enabled else None

    def prepare(self, run: RunView) -> None:
        dist_env = run.dist
        check_world(dist_env.world_size if dist_env.enabled else 1, dist_env.context_parallel, dist_env.strategy)
        if self.g.beta > 0 and peft_model_of(run.model) is None:
            raise ConfigError(f"grpo.beta > 0 compares with the model with its adapter switched off, but method is "
                              f"{run.method}", "use method: lora or qlora, or set grpo.beta: 0 (no reference)")

    def count(self, batch: dict) -> int:
        if self.g.loss_type == "dapo":
            return int((batch_target(batch) != IGNORE_INDEX).sum())
        if self.split is not None and self.split.split.rank:  # a split row counts once, on the group's first rank
            return 0
        return int(batch["input_ids"].shape[0])

    def tokens(self, batch: dict) -> int:
        return int(batch["lengths"].sum())

    @property
    def steps_per_generation_batch(self) -> int:
        """Optimizer steps one generation batch serves: `steps_per_generation` shares, each
        trained `updates_per_generation` times (TRL: steps_per_generation x num_iterations)."""
        return self.g.steps_per_generation * self.g.updates_per_generation

    @property
    def keeps_old_logps(self) -> bool:
        """Whether a step can train on completions its weights did not sample (later updates,
        later shares, or an asynchronous generation): then the sampling policy's log-probs are kept."""
        return self.steps_per_generation_batch > 1 or self.g.async_generation

    def step_batches(self, run: RunView, step: int) -> list[dict]:
        """The micro-batches of optimizer step `step`: one generation batch serves
        `steps_per_generation_batch` consecutive steps (sampled before the first of them); each
        step trains on its share (TRL's order: every share once, then again per update)."""
        per_batch = self.steps_per_generation_batch
        within = (step - 1) % per_batch
        gen, rows = self._generation_for(run, step)
        self._sums = {k: 0.0 for k in _TOKEN_SUMS}
        self._sampled_now = within == 0
        if self.g.async_generation and within == per_batch - 1 and step < run.total_steps:
            self._start_pending(run, gen.index + 1)  # sampled with the weights before this step's update
        micro = self.micro_batch_size
        return [self._share(self._collate(gen, rows[i:i + micro])) for i in range(0, len(rows), micro)]

    def sample_step(self, run: RunView, step: int) -> list[int]:
        """Sample step `step`'s generation batch (if it is the first step it serves) and return
        the token counts of the step's rows (prompt + completion): the trainer decides from them
        whether the step's loss pass runs under the memory meter."""
        gen, rows = self._generation_for(run, step)
        return [len(gen.rows[i]["input_ids"]) for i in rows]

    def _generation_for(self, run: RunView, step: int) -> tuple[Generation, range]:
        """(the generation batch serving step `step`, sampled now unless it already is; the
        indices of the step's share of its rows)."""
        index, within = divmod(step - 1, self.steps_per_generation_batch)
        if self.generation is None or self.generation.index != index:
            pending = self._take_pending(run, index)
            self.generation = None  # free the last one before sampling the next
            self.generation = pending if pending is not None else self._generate(run, index)
        gen = self.generation
        share = len(gen.rows) // self.g.steps_per_generation
        first = (within % self.g.steps_per_generation) * share
        return gen, range(first, first + share)

    def after_backward(self, run: RunView, step: int) -> None:
        """Before the optimizer changes the weights: wait for an asynchronous generation."""
        if self._pending is not None:
            self._pending.join()

    def loss_sum(self, model, batch: dict) -> tuple[torch.Tensor, dict]:
        logps, mask = completion_logps(model, batch, temperature=self.g.temperature,
                                       chunk_size=self.plan.loss_chunk_size, mode=self.mode)
        parts = grpo_loss_sum(logps, mask, batch["advantages"], row_lengths=batch.get("completion_tokens"),
                              old_logps=batch.get("old_logps"),
                              ref_logps=batch.get("ref_logps"), beta=self.g.beta, epsilon=self.g.epsilon,
                              epsilon_high=self.g.epsilon_high, loss_type=self.g.loss_type,
                              max_completion_tokens=self.g.max_completion_tokens,
                              kl_ratio_correction=self.g.kl_ratio_correction)
        for k in _TOKEN_SUMS:
            self._sums[k] = self._sums.get(k, 0.0) + float(getattr(parts, k))
        return parts.loss_sum, {}

    def step_metrics(self) -> dict:
        """This step's generation metrics and its token means (kl, clip ratios)."""
        if self.split is not None:  # each rank summed its share of the tokens
            keys = sorted(self._sums)
            totals = self.split.sum_over_row(torch.tensor([self._sums[k] for k in keys], dtype=torch.float64))
            self._sums = dict(zip(keys, totals.tolist()))
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
    def evaluate(self, run: RunView) -> dict:
        """Greedy completions of the held-out prompts: mean reward, per-function means, lengths."""
        rows = run.data.eval
        if self.cfg.eval.max_batches is not None:
            rows = rows[:self.cfg.eval.max_batches * self.micro_batch_size]
        if not rows:
            return {}
        totals, per_function, lengths = [], [], []
        with self._generating(run.model):
            for start in range(0, len(rows), self.micro_batch_size):
                chunk = rows[start:start + self.micro_batch_size]
                completions = self._greedy(run, chunk)
                for j, (row, ids) in enumerate(zip(chunk, completions)):
                    scores = self._score(run, row, [ids], where=f"held-out prompt {start + j} ({row['where']})")
                    totals.append(scores.total)
                    per_function.append(scores.per_function)
                    lengths.append(len(ids))
        total, per_function = torch.cat(totals), torch.cat(per_function)
        result = {"reward": _nanmean(total), "completion_length": sum(lengths) / len(lengths), "prompts": len(rows)}
        for k, function in enumerate(self.rewards):
            result[f"reward/{function.name}"] = _nanmean(per_function[:, k])
        if self.cfg.eval.prompts:
            from maximus.evaluate import generate_text

            # Chat prompts (message lists) went through the chat template: so do the eval prompts.
            chat = any(isinstance(row["prompt"], list) for row in run.data.train)
            result["generations"] = generate_text(run.model, run.tokenizer, self.cfg.eval.prompts,
                                                  device=run.device, max_new_tokens=self.cfg.eval.max_new_tokens,
                                                  chat=chat)
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

    def _generate(self, run: RunView, index: int, *, in_thread: bool = False) -> Generation:
        """Generation batch `index`: the rows of step `index + 1`'s position in the data order,
        sampled in one batched call (`maximus.train.sampling`), scored, with the log-probs the
        steps need. `in_thread` (asynchronous generation): the model stays in training mode (the
        main thread is training it) and the reference pass, which switches the adapter off, is
        left to `_take_pending`."""
        prompts = run.rows_for_step(index + 1)
        started = time.perf_counter()
        mode = nullcontext() if in_thread else self._generating(run.model)
        record = sampler_records_logps(grpo_settings(self.cfg), self.plan.dtype)  # the kept old log-probs, drawn with the tokens
        with mode, torch.no_grad(), autocast_for(run.device, run.dtype):
            sampled = self.sample(run, [p["prompt_ids"] for p in prompts], index, record_logps=record)
        if self.split is not None:  # the same seed samples the same completions; this makes it certain
            sampled = self.split.broadcast_from_first(sampled)
        generation_s = time.perf_counter() - started
        gen = self.build_generation(run, index, prompts, sampled.completions, reference=not in_thread,
                                    sampled_logps=sampled.logps if record else None)
        gen.metrics.update(generation_s=generation_s, generation_tokens_per_s=sampled.tokens / max(generation_s, 1e-9),
                           generation_prefill_s=sampled.prefill_s, generation_decode_s=sampled.decode_s)
        return gen

    def sample(self, run: RunView, prompt_ids: list[list[int]], index: int, *, record_logps: bool = False):
        """`group_size` sampled completions of each prompt, all in one batched call, seeded by
        (seed, generation index); with `record_logps`, each token's log-prob too (not under vLLM)."""
        from maximus.train.sampling import Draw, sample_groups

        g, tok, device = self.g, run.tokenizer, run.device
        seed = hash((self.cfg.training.seed, index)) % 2**63
        if g.generation == "vllm":
            if self._vllm is None:
                from maximus.train.vllm_generation import VllmSampler

                self._vllm = VllmSampler(self.cfg, self.plan.dtype)
            return self._vllm.sample(run.model, prompt_ids, seed=seed % 2**31, eos_token_id=tok.eos_token_id)
        from maximus.kernels.lean_lora import merged_for_sampling

        generator = torch.Generator(device=device).manual_seed(seed)
        draw = Draw(max_new_tokens=g.max_completion_tokens, eos_token_id=tok.eos_token_id,
                    pad_token_id=self.pad_token_id, temperature=g.temperature, top_p=g.top_p,
                    record_logps=record_logps)
        merged = merged_for_sampling(run.model) if (self.plan.generation or {}).get("merge_lora") else nullcontext()
        with merged:  # the decode loop runs untracked, reporting to the meter (sampling.py)
            return sample_groups(run.model, prompt_ids, draw, group_size=g.group_size, generator=generator,
                                 prompts_at_once=self.prompts_at_once, meter=run.meter)

    @property
    def prompts_at_once(self) -> int | None:
        """Prompts (x group) per decode loop: the plan's (`maximus.memory.generation`); None = all."""
        return (self.plan.generation or {}).get("prompts_at_once")

    def build_generation(self, run: RunView, index: int, prompts: list[dict], completions: list[list[list[int]]], *,
                         reference: bool = True, sampled_logps: list[list[torch.Tensor]] | None = None) -> Generation:
        """Score the sampled `completions[p][i]` (token ids, cut after EOS) of each prompt row,
        and take the reference (`reference`) and sampling-policy log-probs the steps need (module
        doc): the sampler's `sampled_logps[p][i]` when given, else a no-grad pass over the rows."""
        g, eos = self.g, run.tokenizer.eos_token_id
        rows, totals, per_function, truncated, dropped = [], [], [], 0, 0
        step = index * self.steps_per_generation_batch + 1
        for p, (prompt, ids) in enumerate(zip(prompts, completions)):
            truncated += sum(eos not in c for c in ids)
            scores = self._score(run, prompt, ids, where=f"prompt {p} of step {step} ({prompt['where']})")
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
        if reference:
            self._reference_logps(run, gen)
        if self.keeps_old_logps:
            gen.old_logps = (self._logps_of_rows(run, gen) if sampled_logps is None
                             else _aligned_logps(prompts, sampled_logps))
        return gen

    def _reference_logps(self, run: RunView, gen: Generation) -> None:
        if self.g.beta > 0:
            with peft_model_of(run.model).disable_adapter():
                gen.ref_logps = self._logps_of_rows(run, gen)

    # ------------------------------------------------------------------------------ asynchronous generation
    def _start_pending(self, run: RunView, index: int) -> None:
        if self._pending is None or self._pending.index != index:
            self._pending = _PendingGeneration(index, lambda: self._generate(run, index, in_thread=True))

    def _take_pending(self, run: RunView, index: int) -> Generation | None:
        """The asynchronous generation `index` (waited for, its reference pass done now), or None."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        gen = pending.take()
        if pending.index != index:
            return None
        self._reference_logps(run, gen)
        return gen

    def _greedy(self, run: RunView, rows: list[dict]) -> list[list[int]]:
        """One greedy completion per prompt row, all rows in one batched call."""
        from maximus.train.sampling import Draw, sample_groups

        draw = Draw(max_new_tokens=self.g.max_completion_tokens, eos_token_id=run.tokenizer.eos_token_id,
                    pad_token_id=self.pad_token_id, greedy=True)
        out = sample_groups(run.model, [r["prompt_ids"] for r in rows], draw, group_size=1)
        return [group[0] for group in out.completions]

    def _score(self, run: RunView, row: dict, completion_ids: list[list[int]], *, where: str):
        tok = run.tokenizer
        texts = [tok.decode([t for t in c if t != tok.eos_token_id], skip_special_tokens=True) for c in completion_ids]
        chat = isinstance(row["prompt"], list)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if chat else texts
        n = len(completion_ids)
        columns = {k: [v] * n for k, v in row["columns"].items()}
        return score_group(self.rewards, self.g.reward_weights, [row["prompt"]] * n, completions,
                           completion_ids, columns, where=where)

    def _logps_of_rows(self, run: RunView, gen: Generation) -> list[torch.Tensor]:
        """Per-row token log-probs (no_grad) of the model as it is now, micro-batch by micro-batch."""

        out = []
        micro = self.micro_batch_size
        with torch.no_grad():
            for i in range(0, len(gen.rows), micro):
                batch = self._collate(gen, range(i, min(i + micro, len(gen.rows))), with_logps=False)
                batch = {k: v.to(run.device) for k, v in batch.items()}
                with autocast_for(run.device, run.dtype):
                    logps, _ = completion_logps(run.model, batch, temperature=self.g.temperature,
                                                chunk_size=self.plan.loss_chunk_size, mode=self.mode)
                out.extend(logps[j, :int(n)].float().cpu() for j, n in enumerate(batch["lengths"]))
        return out

    def _share(self, batch: dict) -> dict:
        """This rank's share of a micro-batch of whole completions (unchanged without the split):
        the rows' shares (`ContextParallel.share_rows`), the kept log-probs cut alike, each whole
        completion's token count (``completion_tokens``, the ``grpo`` loss's divisor) and the
        share's own real tokens (``lengths``, for tokens/s)."""
        cp = self.split
        if cp is None:
            return batch
        share = cp.share_rows(batch["input_ids"], batch["labels"], batch["position_ids"], self.pad_token_id)
        for name in ("old_logps", "ref_logps"):
            if name in batch:
                share[name] = cp.take_padded(batch[name], 0.0)
        width = batch["input_ids"].shape[1]
        real = torch.arange(width)[None, :] < batch["lengths"][:, None]
        share["lengths"] = cp.take_padded(real, False).sum(dim=1)
        share["completion_tokens"] = (batch_target(batch) != IGNORE_INDEX).sum(dim=1)
        share["advantages"] = batch["advantages"]
        return share

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


class _PendingGeneration:
    """A generation batch sampled on a second thread; `take()` waits and returns it (or raises
    what the thread raised)."""

    def __init__(self, index: int, produce):
        self.index = index
        self._result, self._error = None, None
        self._thread = threading.Thread(target=self._run, args=(produce,), name=f"grpo-generation-{index}", daemon=True)
        self._thread.start()

    def _run(self, produce) -> None:
        try:
            self._result = produce()
        except BaseException as error:  # re-raised in the training thread by take()
            self._error = error

    def join(self) -> None:
        self._thread.join()

    def take(self) -> Generation:
        self.join()
        if self._error is not None:
            raise self._error
        return self._result


def _aligned_logps(prompts: list[dict], sampled: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The sampler's log-probs of each completion's tokens, placed as `completion_logps` places
    them in the row prompt + completion: token j at position len(prompt) + j - 1, zeros elsewhere."""
    out = []
    for prompt, group in zip(prompts, sampled):
        start = len(prompt["prompt_ids"]) - 1
        for logps in group:
            row = torch.zeros(start + 1 + len(logps))
            row[start:start + len(logps)] = logps
            out.append(row)
    return out


def _nanmean(x: torch.Tensor) -> float | None:
    valid = x[~torch.isnan(x)]
    return float(valid.mean()) if valid.numel() else None


def _nanstd(x: torch.Tensor) -> float | None:
    valid = x[~torch.isnan(x)]
    return float(valid.std()) if valid.numel() > 1 else (0.0 if valid.numel() else None)
