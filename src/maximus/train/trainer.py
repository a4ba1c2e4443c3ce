"""The training recipe, top to bottom: setup -> plan -> model + data -> train -> save.

`Trainer(cfg).train()` runs a whole fine-tune and returns the run summary (also written to
`output_dir/run.json`). Features, each switched by the config:

- methods: full fine-tuning, LoRA / DoRA / rsLoRA (PEFT), QLoRA (bitsandbytes NF4, double quant);
- objective: SFT (exact chunked loss by default, Ghost Logit, naive reference), DPO, contrastive or GRPO
  (the objective may sample its own micro-batches: `Objective.step_batches`);
- memory: `target_vram` planning, gradient checkpointing (off / full / selective / auto),
  activation and optimizer offload, the memory meter in the bar, metrics.jsonl and run.json;
- loop: AdamW / 8-bit AdamW, warmup + cosine / linear / constant, gradient accumulation whose
  result equals one big batch (losses are summed then divided by the step's token count),
  clipping, bf16 autocast, seeding;
- safety: atomic verified checkpoints every `save_every` steps and at the end, resume from the
  newest good one by re-running the same command, output-dir lock, non-finite steps skipped
  (stop after `max_bad_steps`), SIGTERM / SIGINT / SIGUSR1 finish the step, checkpoint and exit 75;
- data: the data check (`maximus.data.check`) after the data loads: its summary printed, run.json's
  `data_check`, data_report.json and data_lengths.png; `data.on_problem: error` stops the run there;
- evaluation: exact held-out loss / perplexity / exact match of the base before and of the tuned
  model after, generations for `eval.prompts`; outputs `adapter/` (PEFT format), `run.json`,
  `metrics.jsonl`, `loss.png`.

`_train` is a short loop over named steps (`_measured_step`, `_count_bad_step`, `_log_step`,
`_evaluate_during`, `_checkpoint_or_stop`); re-planning lives in `maximus.train.replanning`, what
a run writes and prints in `maximus.train.outputs`. Helpers get a narrow view of the run
(`maximus.train.views`), never the trainer; the plan in force has one owner, `LivePlan`.

Raises (all `MaximusError`, printed as one line by the CLI): ConfigError, DataError, ModelError,
BudgetError, CheckpointError, TrainingError (too many non-finite steps), Preempted (signal).
Nothing in `output_dir` is touched until the config, data and model have loaded; an `output_dir`
that holds files no Maximus run wrote is refused first (`maximus.train.run_directory`), and the
run removes nothing it did not write.
"""
from __future__ import annotations

import math
import os
import random
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from maximus.config import Config
from maximus.errors import PREEMPTED_EXIT_CODE, ConfigError, MaximusError, Preempted, TrainingError
from maximus.families import untested_family_notice
from maximus.forward import autocast_for
from maximus.kernels import apply_kernels, cpu_threads
from maximus.device import resolve_dtype
from maximus.memory.run_plan import replan
from maximus.memory.spec_from_config import kernel_choices, plan_run, uses_bf16_weights
from maximus.model_source import resolve_source
from maximus.models import load_model, load_tokenizer, resolve_device
from maximus.train import distributed as dist_env
from maximus.train.checkpoint import latest_good_checkpoint, save_checkpoint
from maximus.train.context_parallel import ContextParallel, check_model_config
from maximus.train.lock import RunLock
from maximus.train.metering import MeterPolicy, meter_mode
from maximus.train.objectives import ObjectiveModule, build_objective
from maximus.memory.lengths import split_by_tokens
from maximus.train.optimizers import build_optimizer, check_in_backward, require_packages
from maximus.train.order import RowOrder, row_length, run_lengths, run_steps
from maximus.train.outputs import print_header, print_summary, write_data_report, write_live_plan, write_outputs
from maximus.train.progress import MetricsLog, ProgressDisplay
from maximus.train.replanning import check_budget, guarded_step
from maximus.train.run_directory import check_output_dir, mark_run_directory
from maximus.train.metric_loggers import open_sinks
from maximus.train.views import LivePlan, OutputsView, ReplanView, RunView

__all__ = ["PREEMPTED_EXIT_CODE", "Preempted", "Trainer", "TrainingError"]


@dataclass
class _Run:
    """What the loop carries from one step to the next."""

    out: ProgressDisplay
    ckpt_root: Path
    state: dict  # restored from, and saved into, checkpoints
    start_step: int
    sinks: Any
    metrics: MetricsLog | None
    step: int = 0
    bad_in_row: int = 0
    skipped: int = 0
    peak: int = 0


class Trainer:
    """One fine-tuning run. `hooks` (tests, extensions) may hold callables:
    `after_backward(trainer, step)` called before the finite check and the optimizer step."""

    def __init__(self, cfg: Config, *, hooks: dict | None = None, stream=None):
        from maximus.builtin import resolve

        self.cfg_as_written = cfg  # what run.json records: builtin: names stay names (the cache may be cleared)
        self.cfg = cfg = resolve(cfg)
        self.hooks = hooks or {}
        self.stream = stream
        self.run_dir = Path(cfg.output_dir)
        self._stop_signal: int | None = None
        self.live = LivePlan()  # the plan in force: read by the objective, replaced by re-planning
        self._gathered = None  # under FSDP2: the whole weights the last checkpoint gathered (the final save's)
        self._summary: dict = {}

    # ------------------------------------------------------------------------------ the plan in force
    @property
    def plan(self):
        return self.live.current

    @plan.setter
    def plan(self, plan) -> None:
        self.live.current = plan

    @property
    def replans(self) -> list[dict]:
        return self.live.replans

    @property
    def checkpointing(self):
        return self.live.checkpointing

    @checkpointing.setter
    def checkpointing(self, report) -> None:
        self.live.checkpointing = report

    # ------------------------------------------------------------------------------ setup
    def setup(self) -> None:
        cfg = self.cfg
        self.dist = dist_env.init()
        # training.context_parallel: the ranks that share each row (a collective; checked first).
        # auto: the plan's degree, joined once the model's config is read (below).
        auto_split = cfg.training.context_parallel == "auto"
        self.context = ContextParallel.join(self.dist, 1 if auto_split else cfg.training.context_parallel)
        self.device = resolve_device(cfg.device) if not self.dist.enabled else self.dist.device
        self.dtype = resolve_dtype(cfg.training.dtype, self.device)
        # CPU: as many threads as cores are free for this process (see maximus.kernels.cpu_threads).
        self.threads = cpu_threads(self.device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        _seed_everything(cfg.training.seed)
        check_output_dir(self.run_dir)  # a folder someone else filled is refused before anything loads
        # The model's source, resolved once (files, config, family, vision): everything below takes it.
        self.source = resolve_source(cfg)
        if auto_split:
            self.cfg = cfg = self._join_planned_split()
        require_packages(cfg)  # the optimizer's package, before anything heavy loads
        self._check_model_config()  # what the model's config cannot do: one line, before the data
        # Cheap checks first (model source, tokenizer, data), then the model; all before output_dir is touched.
        self.tokenizer = load_tokenizer(cfg, self.source)
        self.data = self._load_data()
        self.data_report = self._check_data()  # data.on_problem: error stops here, before the model loads
        self.tasks = self._task_eval()  # eval.metrics / eval.few_shot: checked here, before the model loads
        self.total_steps = run_steps(cfg, len(self.data.train))
        self.order = RowOrder(len(self.data.train), cfg.training.batch_size, cfg.training.seed)
        # Tokenized before planning: the plan is for the rows the data really has.
        self.lengths = run_lengths(cfg, self.data.train, steps=self.total_steps, world_size=self.dist.data_world_size)
        # The one config -> plan translation (also `maximus plan` and every torchrun rank's).
        self.plan = plan_run(cfg, device=self.device, world_size=self.dist.data_world_size, lengths=self.lengths,
                             model_config=self.source.config)
        self.method = self.plan.method
        check_in_backward(cfg, grad_accum=self.plan.grad_accum, world_size=self.dist.world_size)
        if cfg.training.optimizer_in_backward and cfg.training.max_grad_norm:
            self.dist.say(f"notice: training.optimizer_in_backward with max_grad_norm {cfg.training.max_grad_norm}: "
                          f"each step runs its backward twice (the first measures the gradient norm, the second "
                          f"steps on clipped gradients); set training.max_grad_norm: null for one backward, unclipped")
        self.weight_store = self._weight_store()
        self.model, _ = load_model(cfg, device=self.device, method=self.method, tokenizer=self.tokenizer,
                                   weight_store=self.weight_store, source=self.source)
        untested = untested_family_notice(self.source.config)
        if untested:
            self.dist.say(untested)
        self.model.train()  # from_pretrained returns eval mode: no dropout, and checkpointed layers would not recompute
        # First, since a model loaded layer by layer has none of its frozen weights on the device.
        self.streamer = self._weight_streamer()
        self.qat = None
        self.qat_steps: frozenset[int] = frozenset()  # the optimizer steps that see the rounding (training.qat_fraction)
        self.checkpointing = self._apply_checkpointing()
        # Padding-free attention, and Triton kernels / regional compilation (optimization.kernels).
        self.kernels = apply_kernels(self.model, cfg.optimization.kernels, self.device,
                                     kernel_choices(cfg, self.device.type, method=self.method))
        self.kernels.threads = self.threads
        for notice in self.kernels.notices:
            self.dist.say(notice)
        self.context.install(self.model, self.dist.say)
        # DDP or FSDP2 under torchrun; FSDP2 replaces parameters by shards, so before the optimizer.
        self.dist.prepare_model(self.model, cfg, self.plan, dtype=self.dtype)
        self.optimizer = self._build_optimizer()
        # After the optimizer: from here `module.weight` reads as the rounded weight in training mode,
        # while the optimizer (and checkpoints) hold the parameters themselves.
        self.qat = self._install_qat()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_lambda)
        from maximus.memory.meter import MemoryMeter

        self.objective = build_objective(cfg, self.live, self.tokenizer.pad_token_id)
        if hasattr(self.objective, "context_parallel"):  # DPO splits its chosen and rejected rows itself
            self.objective.context_parallel = self.context
        # What the loop calls each micro-batch; under torchrun, wrapped for DDP / FSDP2.
        self.step_module = self.dist.wrap(ObjectiveModule(self.model, self.objective), self.optimizer)
        self.meter = MemoryMeter(self.device, budget_bytes=self.plan.budget_bytes)
        self.meter_policy = MeterPolicy(meter_mode(cfg.training.memory_meter, self.device.type), self.total_steps)
        self._build_views()

    def _build_views(self) -> None:
        """What the objective and re-planning read of the run (`maximus.train.views`)."""
        self.run_view = RunView(model=self.model, tokenizer=self.tokenizer, data=self.data, device=self.device,
                                dtype=self.dtype, method=self.method, run_dir=self.run_dir, total_steps=self.total_steps,
                                dist=self.dist, tasks=self.tasks, rows_for_step=self.rows_for_step,
                                meter=self.meter)
        self.replan_view = ReplanView(live=self.live, lengths=self.lengths, model=self.model, optimizer=self.optimizer,
                                      device=self.device, meter=self.meter, max_row_tokens=self.cfg.training.seq_len,
                                      train_step=self.train_step, publish=lambda: write_live_plan(self.outputs_view()))

    def outputs_view(self) -> OutputsView:
        """What the run's outputs read, as it stands now (the streamer, the last gathered weights)."""
        return OutputsView(cfg=self.cfg, cfg_as_written=self.cfg_as_written, run_dir=self.run_dir, dist=self.dist,
                           live=self.live, model=self.model, tokenizer=self.tokenizer, method=self.method,
                           device=self.device, dtype=self.dtype, total_steps=self.total_steps, data=self.data,
                           data_report=self.data_report, kernels=self.kernels, meter=self.meter,
                           optimizer=self.optimizer, streamer=self.streamer, gathered=self._gathered)

    def _join_planned_split(self) -> Config:
        """``training.context_parallel: auto``: the degree the planner picks for rows of
        ``seq_len`` tokens over every process (`memory.planner.plan_for_budget`), joined; the
        config with that degree, so the run's plan (after the data) is planned at it."""
        cfg = self.cfg
        degree = plan_run(cfg, device=self.device, world_size=self.dist.world_size,
                          model_config=self.source.config).context_parallel
        self.dist.say(f"training.context_parallel auto: {degree} of {self.dist.world_size} process(es) share each row")
        self.context = ContextParallel.join(self.dist, degree)
        return cfg.model_copy(update={"training": cfg.training.model_copy(update={"context_parallel": degree})})

    def _check_model_config(self) -> None:
        """One line, before the data loads, for a model whose attention the context split would
        change (training.context_parallel) or whose export cannot hold the QAT target (training.qat)."""
        cfg = self.cfg
        if self.context.split.enabled:
            longest_row = cfg.training.seq_len + (cfg.grpo.max_completion_tokens if cfg.objective == "grpo" else 0)
            check_model_config(self.source.config, cfg.training.context_parallel, longest_row)
        if cfg.training.qat != "off":
            from maximus.qat.check import check_qat

            check_qat(cfg, self.source.config)

    def _weight_store(self):
        """Where the plan's streamed layers live (`optimization.offload.params`, or the planner's
        choice under `auto`: host memory or a file), checked against this machine's free memory or
        disk before the model loads; None without streaming or for full fine-tuning (nothing is frozen)."""
        if not self.plan.offload_params or self.method == "full":
            return None
        mode = "disk" if self.plan.params_store == "disk" else "on"
        from maximus.layerwise_load import weight_store_for_run

        return weight_store_for_run(self.source, mode, device=self.device, dtype=self.dtype, method=self.method)

    def _weight_streamer(self):
        """With the plan's `offload_params`: frozen base weights live on the host (or in a file) and
        reach the device one layer ahead of use (`maximus.memory.weight_streaming`); else None."""
        if not self.plan.offload_params:
            return None
        from maximus.memory.weight_streaming import FrozenWeightStreamer

        return FrozenWeightStreamer(self.model, self.weight_store)

    def _install_qat(self):
        """`training.qat`: the model's matrices read as the export will round them, in training
        mode (`maximus.qat.install`); None when off."""
        target = self.cfg.training.qat
        if target == "off":
            return None
        from collections import Counter

        from maximus.qat.install import install_qat

        report = install_qat(self.model, target, adapter=self.cfg.training.qat_adapter)
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(Counter(report.types.values()).items()))
        training = self.cfg.training
        correction = self._qat_correction(report) if training.qat_correction_rank else ""
        start = training.qat_first_step(self.total_steps)
        self.qat_steps = training.qat_steps(self.total_steps)
        self.dist.say(f"quantization-aware training for {target}: {len(report.types)} matrices fake-quantized ({kinds})"
                      + ("; the adapter trains in float beside the rounded base, as --format gguf-lora serves it "
                         "(training.qat_adapter: separate)" if training.qat_adapter == "separate" else "")
                      + correction
                      + (f", from step {start} of {self.total_steps} (training.qat_start)" if start > 1 else "")
                      + (self._qat_share(report, start) if training.qat_fraction != 1 else "")
                      + (f"; each step's loss {1 - training.qat_float_weight:g} x rounded + "
                         f"{training.qat_float_weight:g} x float weights, two passes per micro-batch "
                         "(training.qat_float_weight)" if training.qat_float_weight else ""))
        return report

    def _qat_correction(self, report) -> str:
        """`training.qat_correction_rank`: each adapted base reads as Q(W) + its low-rank correction
        (`maximus.qat.correction`), computed now from the first training rows; the header's words."""
        import time

        from maximus.qat.correction import calibration_rows, rounding_corrections
        from maximus.qat.install import apply_corrections

        rank = self.cfg.training.qat_correction_rank
        if self.streamer is not None:
            raise ConfigError(f"training.qat_correction_rank {rank} reads every base weight at once, and the plan "
                              "streams the frozen weights from the host",
                              "give the run more memory (target_vram) or remove training.qat_correction_rank")
        rows = calibration_rows(self.data.train, self.cfg.objective, asked=f"training.qat_correction_rank {rank}",
                                drop="remove training.qat_correction_rank")
        started = time.perf_counter()
        factors = rounding_corrections(self.model, rows, rank, report.apart, self.device)
        apply_corrections(report, factors)
        return (f"; a rank-{rank} correction of the base's rounding beside the adapter, from {len(rows)} training "
                f"rows in {time.perf_counter() - started:.1f} s (training.qat_correction_rank)")

    def _qat_share(self, report, start: int) -> str:
        """The header's words for `training.qat_fraction` below 1."""
        training = self.cfg.training
        if training.qat_noise == "steps":
            return (f", rounded on {len(self.qat_steps)} of those {self.total_steps - start + 1} steps "
                    f"(training.qat_fraction {training.qat_fraction:g})")
        rounded = sum(training.qat_matrices(start, len(report.roundings)))
        return f", {rounded} of {len(report.roundings)} rounded each step (training.qat_fraction {training.qat_fraction:g})"

    def _load_data(self):
        from maximus.data import build_run_datasets

        return build_run_datasets(self.cfg, self.tokenizer, source=self.source)

    def _check_data(self):
        """The data check's summary (`maximus.data.check`), printed; None for image + text data."""
        from maximus.data.check import check_run

        if not self.data.records:
            return None
        report = check_run(self.cfg, self.data, self.tokenizer)
        for line in report.lines():
            self.dist.say(line)
        report.raise_problems()  # under data.on_problem: error
        return report

    def _task_eval(self):
        from maximus.evaluate.tasks import task_eval_for_run

        return task_eval_for_run(self.cfg, self.tokenizer, self.data)

    def _apply_checkpointing(self):
        """The plan's recompute modes (and MLP tiles) on the model. A plan the estimator could
        not make (an architecture it cannot read, no budget) has none: the config's policy is
        applied (`auto`: least memory at <= 25 % extra time, from measured layer costs) and the
        plan takes the modes chosen."""
        from maximus.memory.checkpointing import apply_checkpointing

        plan = self.plan
        report = apply_checkpointing(self.model, list(plan.recompute) or self.cfg.optimization.gradient_checkpointing,
                                     micro_batch=plan.micro_batch_size, seq_len=self.cfg.training.seq_len,
                                     offload_activations=plan.offload_activations, tile_tokens=plan.tile_tokens)
        if not plan.recompute:
            self.plan = replan(plan, self.lengths, recompute=tuple(report.modes))
        from maximus.vision import vision_parts

        if self.cfg.lora.vision and any(m != "none" for m in report.modes) and self.source.vision:
            # A trained tower is recomputed whenever the language model is (as planned: vision_terms).
            from maximus.memory.checkpointing import checkpoint_tower
            from maximus.structure import causal_lm_of

            checkpoint_tower(causal_lm_of(self.model).get_submodule(vision_parts(self.model).tower))
        if plan.tile_tokens and report.tile_tokens is None:
            self.dist.say(f"notice: optimization.tile_tokens={plan.tile_tokens} has no effect: no layer is "
                          f"fully recomputed (gradient_checkpointing: {self.cfg.optimization.gradient_checkpointing})")
        return report

    def _build_optimizer(self):
        """`training.optimizer` over the trainable parameters (maximus.train.optimizers)."""
        return build_optimizer(self.model, self.cfg.training, optimizer=self.plan.optimizer,
                               offload=self.plan.offload_optimizer, bf16_weights=uses_bf16_weights(self.cfg))


    def _lr_lambda(self, step: int) -> float:
        return lr_factor(step, self.cfg.training, self.total_steps)

    # ------------------------------------------------------------------------------ data order
    def _flatten(self, rows: list[dict]) -> bool:
        """Whether a micro-batch goes in as one unpadded row (`maximus.data.flatten`): unpacked
        SFT rows (packed ones are already full) under padding-free attention, when attention will
        run one SDPA call per row-document (many short rows run faster padded)."""
        from maximus.attention.varlen import per_document

        if not self.kernels.padding_free or self.objective.name != "sft" or self.cfg.training.packing:
            return False
        return per_document(len(rows), sum(len(r["input_ids"]) for r in rows))

    def rows_for_step(self, step: int) -> list[dict]:
        """The rows of optimizer step `step` (1-based) for this rank: the global stream is the
        concatenation of per-epoch permutations (seeded), so position = step alone."""
        return self.dist.shard([self.data.train[i] for i in self.order.step(step)])

    # ------------------------------------------------------------------------------ one step
    def train_step(self, step: int) -> dict:
        """One optimizer step over `batch_size` rows, split into micro-batches. Losses are sums
        divided by the whole step's unit count (tokens, or pairs for DPO) across micro-batches
        and ranks, so accumulation gives the gradient of one big batch."""
        from maximus.data import collate, flatten

        obj = self.objective
        in_backward = getattr(self.optimizer, "steps_in_backward", False)  # training.optimizer_in_backward
        if in_backward:
            self.optimizer.begin_step()
        batches = obj.step_batches(self.run_view, step)  # GRPO samples its own
        if batches is None:
            rows = self.rows_for_step(step)
            if self.plan.micro_batch_tokens:  # by a token budget, longest rows first (same loss: sums / units)
                groups = split_by_tokens([row_length(r) for r in rows], self.plan.micro_batch_tokens)
                chunks = [[rows[i] for i in g] for g in groups]
            else:
                micro = self.plan.micro_batch_size
                chunks = [rows[i:i + micro] for i in range(0, len(rows), micro)]
            batches = [flatten(c) if self._flatten(c) else collate(c, self.tokenizer.pad_token_id) for c in chunks]
            batches = [self.context.share(b, self.tokenizer.pad_token_id) for b in batches]
        units = self.dist.all_reduce_int(sum(obj.count(b) for b in batches))
        tokens = sum(obj.tokens(b) for b in batches)
        scale = self.dist.world_size / max(units, 1)
        max_norm = self.cfg.training.max_grad_norm
        measured = None
        if in_backward and max_norm:
            # Clipping inside the backward: a first backward sums the global norm (no weight
            # changes; the same random draws as the second, which steps on clipped gradients).
            devices = [self.device] if self.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices), self.optimizer.measuring():
                self._backward(batches, scale)
            measured = self.optimizer.clip_to(max_norm)
        if measured is not None and not math.isfinite(measured):
            loss_total, sums = torch.tensor(float("nan"), dtype=torch.float64), {}  # no weight changed
        else:
            loss_total, sums = self._backward(batches, scale)
        obj.after_backward(self.run_view, step)  # GRPO: an asynchronous generation finishes before the weights change
        if "after_backward" in self.hooks:
            self.hooks["after_backward"](self, step)
        loss_total = self.dist.all_reduce_sum(loss_total)
        loss = float(loss_total) / max(units, 1)
        params = [p for p in self.model.parameters() if p.requires_grad]
        if in_backward:  # every weight stepped already; the norm was summed as the gradients passed
            grad_norm = torch.tensor(self.optimizer.grad_norm() if measured is None else measured)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else float("inf"))
        finite = math.isfinite(loss) and bool(torch.isfinite(grad_norm))
        if finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        extra = {k: v / max(units, 1) for k, v in sums.items()}
        extra.update(obj.step_metrics())
        return {"loss": loss if finite else None, "grad_norm": float(grad_norm) if finite else None,
                "finite": finite, "tokens": tokens * self.dist.world_size, "units": units, "metrics": extra}

    def _backward(self, batches: list[dict], scale: float) -> tuple[torch.Tensor, dict[str, float]]:
        """Forward and backward of the step's micro-batches (losses times `scale`): the summed loss
        and metric sums."""
        loss_total = torch.zeros((), device=self.device, dtype=torch.float64)
        sums: dict[str, float] = {}
        passes = self._loss_passes()
        for i, batch in enumerate(batches):
            batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
            for j, (name, weight, weights_as_they_are) in enumerate(passes):
                # DDP: gradients are all-reduced once per optimizer step, in its last backward.
                last = i == len(batches) - 1 and j == len(passes) - 1
                sync = nullcontext() if last or not hasattr(self.step_module, "no_sync") else self.step_module.no_sync()
                with sync, self.context.attending(batch), weights_as_they_are():
                    with autocast_for(self.device, self.dtype):
                        loss_sum, metric_sums = self.step_module(batch)
                    (loss_sum * (scale * weight)).backward()
                loss_total += loss_sum.detach().double() * weight
                for k, v in metric_sums.items():
                    sums[k] = sums.get(k, 0.0) + float(v) * weight
                if name:
                    sums[name] = sums.get(name, 0.0) + float(loss_sum.detach())
        return loss_total, sums

    def _loss_passes(self) -> list[tuple[str | None, float, Callable]]:
        """The passes of each micro-batch: (its loss's metric name, its weight in the step's loss,
        the context its forward and backward run in). One plain pass; under training.qat_float_weight
        w, on a step that rounds, the rounded pass (1 - w) and the float pass (w)."""
        weight = self.cfg.training.qat_float_weight
        if self.qat is None or not weight or not self.qat.rounds:
            return [(None, 1.0, nullcontext)]
        return [("qat_rounded_loss", 1.0 - weight, nullcontext), ("qat_float_loss", weight, self.qat.floating)]

    # ------------------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict:
        if not self.cfg.eval.enabled or not (self.data.eval or self.cfg.eval.prompts):
            return {}
        return self.objective.evaluate(self.run_view)

    # ------------------------------------------------------------------------------ the run
    def train(self) -> dict:
        started = time.time()
        lock = None
        finished = False  # True once training returned: the ranks then leave together (DistEnv.shutdown)
        try:
            self.setup()
            # Rank 0 owns output_dir; the others go on only once it holds the lock (and the
            # directory exists), and stop too when it cannot.
            error = None
            if self.dist.is_main:
                lock = RunLock(self.run_dir)
                try:
                    lock.acquire()
                except MaximusError as exc:
                    error = exc
            if not self.dist.all_ok(error is None):
                raise error or MaximusError("rank 0 could not start this run", "see rank 0's error")
            if self.dist.is_main:
                mark_run_directory(self.run_dir)
            with self.dist.session():
                self.objective.prepare(self.run_view)  # may write into output_dir (DPO reference cache): after the lock
                summary = self._train(started)
            finished = True
            return summary
        finally:
            if lock:
                lock.release()
            if hasattr(self, "dist"):
                self.dist.shutdown(clean=finished)  # destroys the process group, also after an error

    def _train(self, started: float) -> dict:
        run = self._open_run()
        self._evaluate_before(run)
        previous = self._install_signal_handlers()
        try:
            for step in range(run.start_step + 1, self.total_steps + 1):
                run.step = step
                if self.qat is not None:  # training.qat_start / qat_fraction: the other steps train in float
                    rounds = step in self.qat_steps
                    self.qat.set_active(self.cfg.training.qat_matrices(step, len(self.qat.roundings)) if rounds else False)
                row, finite = self._measured_step(step, run)
                self._count_bad_step(row, finite, run)
                self._log_step(row, run)
                self._evaluate_during(step, run)
                self._checkpoint_or_stop(step, run)
            self._save(run.ckpt_root, run.step, run.state)
        finally:
            self._restore_signal_handlers(previous)
            self._close_logs(run, failed=sys.exc_info()[1] is not None)
        eval_after = self.evaluate() if self.cfg.eval.enabled else {}
        if run.sinks is not None:
            run.sinks.eval("after", run.step, eval_after)
            run.sinks.close()
        if self.dist.is_main:
            self._summary = write_outputs(self.outputs_view(), run.state, eval_after, run.peak, run.skipped, started)
            print_summary(self.outputs_view(), self._summary, run.state.get("eval_before", {}), eval_after)
        return self._summary

    # ------------------------------------------------------------------------------ the loop's steps
    def _open_run(self) -> _Run:
        """Resume from the newest good checkpoint, print the header, open metrics.jsonl and the sinks."""
        cfg, run_dir = self.cfg, self.run_dir
        ckpt_root = run_dir / "checkpoints"
        out = ProgressDisplay(self.total_steps, mode=cfg.logging.progress if self.dist.is_main else "none",
                              every=cfg.training.log_every, budget_bytes=self.plan.budget_bytes, stream=self.stream)
        ckpt = latest_good_checkpoint(ckpt_root, warn=out.message)
        state: dict = {}
        start_step = 0
        if ckpt is not None:
            state = ckpt.restore(self.model, self.optimizer)
            start_step = state["step"]
            self.scheduler.load_state_dict(state["scheduler"])
            out.message(f"resuming from {ckpt.path} (step {start_step}/{self.total_steps})")
        out.start = start_step
        outputs = self.outputs_view()
        print_header(outputs, out)
        write_live_plan(outputs)
        write_data_report(outputs)
        # Rank 0 alone owns metrics.jsonl (another rank re-creating it would cut rank 0's file) and the sinks.
        sinks = (open_sinks(cfg.logging, run_dir, resume_step=start_step, budget_bytes=self.plan.budget_bytes,
                            config=cfg.model_dump(mode="json")) if self.dist.is_main else None)
        metrics = MetricsLog(run_dir / "metrics.jsonl", resume_step=start_step, sinks=sinks) if self.dist.is_main else None
        return _Run(out=out, ckpt_root=ckpt_root, state=state, start_step=start_step, sinks=sinks, metrics=metrics,
                    step=start_step, bad_in_row=state.get("bad_in_row", 0), skipped=state.get("skipped_steps", 0),
                    peak=state.get("peak_memory_bytes", 0))

    def _evaluate_before(self, run: _Run) -> None:
        """The base model's held-out metrics and its prompting baseline, on a fresh start only
        (a resumed run has them)."""
        cfg, state = self.cfg, run.state
        if run.start_step != 0:
            return
        if cfg.eval.enabled and cfg.eval.before:
            before = state["eval_before"] = self.evaluate()
            if run.sinks:
                run.sinks.eval("before", 0, before)
            if "loss" in before:
                run.out.message(f"base model: held-out loss {before['loss']:.4f}")
        if self.tasks is not None and self.tasks.prompted:  # the base, before any step
            state["eval_prompted"] = self.tasks.score_prompted(self.model, device=self.device, dtype=self.dtype,
                                                               batch_size=self.plan.micro_batch_size)
            from maximus.evaluate.report import column_label

            run.out.message(f"{column_label(state['eval_prompted'])}: held-out loss {state['eval_prompted']['loss']:.4f}")

    def _measured_step(self, step: int, run: _Run) -> tuple[dict, bool]:
        """One optimizer step, under the memory meter when `training.memory_meter` says so
        (re-planned after an out-of-memory error or a metered peak over the budget): its metrics
        row, and whether its loss and gradient were finite."""
        t0 = time.perf_counter()
        self.meter.reset_peak()  # each row's peak_memory_bytes is that step's own peak
        lengths = self._step_lengths(step, run)
        metered = self.meter_policy.decide(step, self.plan, lengths)
        if metered:
            if self.meter_policy.mode == "sampled" and not self._samples_own_rows:  # what an unmetered step re-allocated
                self.meter.adopt(self.model, self.optimizer)
            with self.meter.track(self.model, self.optimizer):
                result = guarded_step(self.replan_view, step, run.out.message)
        else:
            result = guarded_step(self.replan_view, step, run.out.message)
        elapsed = time.perf_counter() - t0
        # float(): torchao's optimizers hold lr as a tensor
        row = {"step": step, "loss": result["loss"], "lr": float(self.scheduler.get_last_lr()[0]),
               "grad_norm": result["grad_norm"], "tokens_per_s": result["tokens"] / max(elapsed, 1e-9),
               "step_time_s": elapsed, "tokens": result["tokens"]}
        if metered:
            step_peak = self.meter.peak_bytes()
            run.peak = max(run.peak, step_peak)
            check_budget(self.replan_view, step, run.out.message)
            row.update(memory_bytes=self.meter.current_bytes(), peak_memory_bytes=step_peak)
        row.update(result["metrics"])
        return row, result["finite"]

    @property
    def _samples_own_rows(self) -> bool:
        """Whether the objective forms its own rows (`Objective.sample_step`: GRPO samples them)."""
        from maximus.train.objectives.base import Objective

        return type(self.objective).sample_step is not Objective.sample_step

    def _step_lengths(self, step: int, run: _Run) -> list[int]:
        """The token counts of step `step`'s rows, which the meter policy decides on. An objective
        that samples its rows (GRPO) samples them here, always under the meter (its decode loop
        reports what it holds rather than being tracked op by op: `maximus.train.sampling`), so
        a generation's peak reaches the run's peak whether or not the rest of the step is metered."""
        if not self._samples_own_rows:
            return [row_length(r) for r in self.rows_for_step(step)]
        if self.meter_policy.mode == "sampled":  # what an unmetered step re-allocated
            self.meter.adopt(self.model, self.optimizer)
        with self.meter.track(self.model, self.optimizer):
            lengths = guarded_step(self.replan_view, step, run.out.message,
                                   work=lambda: self.objective.sample_step(self.run_view, step))
        run.peak = max(run.peak, self.meter.peak_bytes())
        return lengths

    def _count_bad_step(self, row: dict, finite: bool, run: _Run) -> None:
        """The bad-step policy: a non-finite step was skipped (no update); `max_bad_steps` of them
        in a row stop the run with TrainingError (its row is logged first)."""
        if finite:
            run.bad_in_row = 0
            return
        run.bad_in_row += 1
        run.skipped += 1
        row["skipped"] = True
        step = row["step"]
        run.out.message(f"warning: step {step} had a non-finite loss or gradient; skipped (no update)")
        if run.bad_in_row >= self.cfg.training.max_bad_steps:
            if run.metrics is not None:
                run.metrics.write(row)
            raise TrainingError(f"{run.bad_in_row} consecutive steps had a non-finite loss or gradient (last: step {step})",
                                "lower training.learning_rate or check the data; the last good checkpoint is kept")

    def _log_step(self, row: dict, run: _Run) -> None:
        """metrics.jsonl (and the sinks through it), the progress display, the checkpointed state."""
        if run.metrics is not None:
            run.metrics.write(row)
        run.out.update(row)
        run.state.update(bad_in_row=run.bad_in_row, skipped_steps=run.skipped, peak_memory_bytes=run.peak)

    def _evaluate_during(self, step: int, run: _Run) -> None:
        """Held-out loss every `eval.every` steps (the last step's comes with the after-evaluation)."""
        every = self.cfg.eval.every
        if every and step % every == 0 and step < self.total_steps:
            ev = self.evaluate()
            if ev and run.metrics is not None:
                run.metrics.write({"step": step, "eval_loss": ev.get("loss"), "eval_perplexity": ev.get("perplexity")})

    def _checkpoint_or_stop(self, step: int, run: _Run) -> None:
        """A checkpoint every `save_every` steps; after a stop signal (on any rank: every rank
        stops at the same step), a checkpoint and Preempted."""
        save_every = self.cfg.training.save_every
        stop = self.dist.any(self._stop_signal is not None)
        if step < self.total_steps and ((save_every and step % save_every == 0) or stop):
            self._save(run.ckpt_root, step, run.state)
        if stop:
            name = signal.Signals(self._stop_signal).name
            raise Preempted(f"stopped by {name} after step {step}/{self.total_steps}; checkpoint saved in {run.ckpt_root}",
                            "re-run the same command to resume")

    @staticmethod
    def _close_logs(run: _Run, *, failed: bool) -> None:
        if run.metrics is not None:
            run.metrics.close()
        if run.sinks is not None and failed:
            run.sinks.close()  # a failed or stopped run still ends its W&B / MLflow run
        run.out.close()

    def _save(self, root: Path, step: int, state: dict) -> None:
        # Under FSDP2 every rank helps gather whole tensors; rank 0 alone writes.
        model, optimizer = self.dist.checkpoint_view(self.model, self.optimizer)
        if not self.dist.is_main:
            return
        self._gathered = model if model is not self.model else None  # for the final weights (OutputsView.gathered)
        save_checkpoint(root, step, model, optimizer, {**state, "scheduler": self.scheduler.state_dict()},
                        keep=self.cfg.training.keep_checkpoints)

    # ------------------------------------------------------------------------------ signals
    def _install_signal_handlers(self) -> dict:
        previous = {}

        def handler(signum, frame):
            if self._stop_signal is not None:
                os._exit(128 + signum)  # second signal: stop now
            self._stop_signal = signum

        for sig in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGUSR1", None)):
            if sig is None:
                continue
            try:
                previous[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread
                pass
        return previous

    @staticmethod
    def _restore_signal_handlers(previous: dict) -> None:
        for sig, h in previous.items():
            signal.signal(sig, h)


def lr_factor(step: int, t, total_steps: int) -> float:
    """The learning rate of optimizer step `step` (0-based) over `training.learning_rate`: linear
    warm-up (step + 1) / (warmup + 1), then `t.scheduler`'s decay over the remaining steps."""
    warm = t.warmup_steps if t.warmup_steps >= 1 else round(t.warmup_steps * total_steps)
    warm = int(warm)
    if step < warm:
        return (step + 1) / (warm + 1)
    if t.scheduler == "constant":
        return 1.0
    progress = (step - warm) / max(1, total_steps - warm)
    progress = min(max(progress, 0.0), 1.0)
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if t.scheduler == "cosine" else 1 - progress
    return t.min_lr_ratio + (1 - t.min_lr_ratio) * decay


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover
        pass

