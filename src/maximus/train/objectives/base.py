"""What one micro-batch costs: the protocol every objective follows, and the default (`sft`).

The forward path they share (hidden states, output head, shifted labels, the loss sum) lives in
`maximus.forward`: no tokens x vocabulary logits tensor exists anywhere in training with the
default (`exact`) loss.
"""
from __future__ import annotations

import torch

from maximus.data import trains_on_chat
from maximus.evaluate import evaluate_sft
from maximus.forward import IGNORE_INDEX, batch_target, sft_loss_sum
from maximus.memory.plan import Plan
from maximus.train.views import LivePlan, RunView


class Objective:
    """What every objective keeps (the config, the memory plan, the pad id); see `SFTObjective`
    for the protocol. `plan`: the trainer's `LivePlan` (the plan in force, which re-planning
    replaces between steps: read here, never copied), or a fixed `Plan` for an objective used
    on its own. The run is read through a `maximus.train.views.RunView`."""

    name = "objective"

    def __init__(self, cfg, plan: Plan | LivePlan, pad_token_id: int):
        self.cfg = cfg
        self.live = plan if isinstance(plan, LivePlan) else LivePlan(plan)
        self.pad_token_id = pad_token_id

    @property
    def plan(self) -> Plan:
        """The plan in force (read per step: a re-plan may change the micro-batch or the loss chunk)."""
        return self.live.current

    def step_batches(self, run: RunView, step: int) -> list[dict] | None:
        """The micro-batches of optimizer step `step`, for an objective that makes its own (GRPO
        samples them); None = the trainer collates `rows_for_step(step)`."""
        return None

    def sample_step(self, run: RunView, step: int) -> list[int] | None:
        """For an objective that makes its own micro-batches (GRPO samples them): form step
        `step`'s rows now, before the trainer decides whether the rest of the step runs under the
        memory meter, and return their token counts (what `maximus.train.metering` decides on).
        `step_batches` then batches the same rows. None (the default): the trainer's rows."""
        return None

    def after_backward(self, run: RunView, step: int) -> None:
        """Called once the step's backward is done, before the optimizer step (GRPO waits for its
        asynchronous generation here); nothing by default."""

    def step_metrics(self) -> dict:
        """Metrics of the step just run that are not per-unit sums (GRPO's rewards); {} by default."""
        return {}

    def refuse_ghost_logit(self, why: str) -> None:
        """The Ghost Logit loss replaces a vocabulary softmax; objectives without one refuse it."""
        opt = self.cfg.optimization
        if opt.loss_mode != "ghost":
            return
        from maximus.errors import ConfigError

        if opt.use_ghost_logit:  # name the key the user wrote
            raise ConfigError(f"optimization.use_ghost_logit does not apply to objective {self.name}",
                              f"set use_ghost_logit: false; {why}")
        raise ConfigError(f"optimization.loss: ghost does not apply to objective {self.name}",
                          f"set optimization.loss: exact; {why}")


class SFTObjective(Objective):
    """Next-token cross-entropy on target tokens. The protocol every objective follows:

    - `count(batch)`: normalisation units in a micro-batch (target tokens here; pairs for DPO);
      the step's loss is sum(loss_sum) / sum(count) over all micro-batches (and ranks);
    - `tokens(batch)`: input tokens processed, for tokens/s;
    - `loss_sum(model, batch) -> (Tensor, {metric: summed value})`;
    - `prepare(run)`: once before training (e.g. cache reference log-probs);
    - `evaluate(run) -> dict`: held-out metrics, always with the exact loss.
    """

    name = "sft"

    def __init__(self, cfg, plan: Plan | LivePlan, pad_token_id: int):
        super().__init__(cfg, plan, pad_token_id)
        g = cfg.optimization.ghost_logit
        user_chunk = cfg.optimization.loss_chunk_size
        self.ghost = {"num_candidates": g.candidates, "prefix_dims": g.prefix_dims,
                      "chunk_size": user_chunk if isinstance(user_chunk, int) else None}

    def prepare(self, run: RunView) -> None:
        pass

    def count(self, batch: dict) -> int:
        return int((batch_target(batch) != IGNORE_INDEX).sum())

    def tokens(self, batch: dict) -> int:
        return int((batch["input_ids"] != self.pad_token_id).sum())

    def loss_sum(self, model, batch: dict) -> tuple[torch.Tensor, dict]:
        metrics: dict = {}  # a mixture of experts reports its router load-balancing loss here
        loss, _ = sft_loss_sum(model, batch, mode=self.plan.loss_mode, chunk_size=self.plan.loss_chunk_size,
                               ghost=self.ghost, matryoshka=self.cfg.optimization.matryoshka, metrics=metrics)
        return loss, metrics

    def evaluate(self, run: RunView) -> dict:
        return evaluate_sft(run.model, run.tokenizer, run.data.eval, cfg=self.cfg, tasks=run.tasks, device=run.device,
                            dtype=run.dtype, batch_size=self.plan.micro_batch_size, chat=trains_on_chat(run.data.stats))


class ObjectiveModule(torch.nn.Module):
    """model + objective as one module whose forward returns (loss_sum, metric sums), so that DDP
    (which syncs gradients only for forwards run through it) can wrap the whole training forward."""

    def __init__(self, model, objective):
        super().__init__()
        self.model = model
        self.objective = objective

    def forward(self, batch: dict):
        return self.objective.loss_sum(self.model, batch)
