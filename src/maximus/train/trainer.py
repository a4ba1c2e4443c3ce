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
- evaluation: exact held-out loss / perplexity / exact match of the base before and of the tuned
  model after, generations for `eval.prompts`; outputs `adapter/` (PEFT format), `run.json`,
  `metrics.jsonl`, `loss.png`.

Raises (all `MaximusError`, printed as one line by the CLI): ConfigError, DataError, ModelError,
BudgetError, CheckpointError, TrainingError (too many non-finite steps), Preempted (signal).
Nothing in `output_dir` is touched until the config, data and model have loaded.
"""
from __future__ import annotations

import math
import os
import platform
import random
import shutil
import signal
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from maximus.config import Config
from maximus.errors import MaximusError
from maximus.forward import autocast_for
from maximus.kernels import apply_kernels, cpu_threads
from maximus.memory.run_plan import plan_run, replan, resolve_dtype
from maximus.models import check_model_source, count_parameters, load_model, load_tokenizer, resolve_device
from maximus.train import distributed as dist_env
from maximus.train.checkpoint import fsync_dir, latest_good_checkpoint, save_checkpoint, write_json
from maximus.train.lock import RunLock
from maximus.train.objectives import ObjectiveModule, build_objective
from maximus.memory.lengths import split_by_tokens
from maximus.train.order import RowOrder, row_length, run_lengths, run_steps
from maximus.train.progress import MetricsLog, ProgressDisplay, plot_loss
from maximus.train.sinks import open_sinks

PREEMPTED_EXIT_CODE = 75


class TrainingError(MaximusError):
    """Training cannot go on (e.g. too many non-finite steps in a row)."""


class Preempted(MaximusError):
    """A stop signal arrived; a checkpoint was written and the run can resume."""

    exit_code = PREEMPTED_EXIT_CODE


class Trainer:
    """One fine-tuning run. `hooks` (tests, extensions) may hold callables:
    `after_backward(trainer, step)` called before the finite check and the optimizer step."""

    def __init__(self, cfg: Config, *, hooks: dict | None = None, stream=None):
        from maximus.builtin import resolve

        self.cfg = cfg = resolve(cfg)
        self.hooks = hooks or {}
        self.stream = stream
        self.run_dir = Path(cfg.output_dir)
        self._stop_signal: int | None = None
        self.replans: list[dict] = []
        self._summary: dict = {}

    # ------------------------------------------------------------------------------ setup
    def setup(self) -> None:
        cfg = self.cfg
        self.dist = dist_env.init()
        self.device = resolve_device(cfg.device) if not self.dist.enabled else self.dist.device
        self.dtype = resolve_dtype(cfg.training.dtype, self.device)
        # CPU: as many threads as cores are free for this process (see maximus.kernels.cpu_threads).
        self.threads = cpu_threads(self.device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        _seed_everything(cfg.training.seed)
        check_model_source(cfg)
        # Cheap checks first (model source, tokenizer, data), then the model; all before output_dir is touched.
        self.tokenizer = load_tokenizer(cfg)
        self.data = self._load_data()
        self.tasks = self._task_eval()  # eval.metrics / eval.few_shot: checked here, before the model loads
        self.total_steps = run_steps(cfg, len(self.data.train))
        self.order = RowOrder(len(self.data.train), cfg.training.batch_size, cfg.training.seed)
        # Tokenized before planning: the plan is for the rows the data really has.
        self.lengths = run_lengths(cfg, self.data.train, steps=self.total_steps, world_size=self.dist.world_size)
        # The one config -> plan translation (also `maximus plan` and every torchrun rank's).
        self.plan = plan_run(cfg, device=self.device, world_size=self.dist.world_size, lengths=self.lengths)
        self.method = self.plan.method
        self.model, _ = load_model(cfg, device=self.device, method=self.method, tokenizer=self.tokenizer)
        self.model.train()  # from_pretrained returns eval mode: no dropout, and checkpointed layers would not recompute
        self.checkpointing = self._apply_checkpointing()
        # Padding-free attention, and Triton kernels / regional compilation (optimization.kernels).
        self.kernels = apply_kernels(self.model, cfg.optimization.kernels, self.device, lean_lora=cfg.optimization.lean_lora,
                                     lean_norm=cfg.optimization.lean_norm)
        self.kernels.threads = self.threads
        for notice in self.kernels.notices:
            self.dist.say(notice)
        self.streamer = None
        if cfg.optimization.offload.params == "on":
            from maximus.memory.offload import FrozenWeightStreamer

            # Frozen base weights live on the host and reach the device one layer ahead of use.
            self.streamer = FrozenWeightStreamer(self.model)
        # DDP or FSDP2 under torchrun; FSDP2 replaces parameters by shards, so before the optimizer.
        self.dist.prepare_model(self.model, cfg, self.plan, dtype=self.dtype)
        self.optimizer = self._build_optimizer()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_lambda)
        from maximus.memory.meter import MemoryMeter

        self.objective = build_objective(cfg, self.plan, self.tokenizer.pad_token_id)
        # What the loop calls each micro-batch; under torchrun, wrapped for DDP / FSDP2.
        self.step_module = self.dist.wrap(ObjectiveModule(self.model, self.objective), self.optimizer)
        self.meter = MemoryMeter(self.device, budget_bytes=self.plan.budget_bytes)

    def _load_data(self):
        from maximus.data import build_run_datasets

        return build_run_datasets(self.cfg, self.tokenizer)

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
            self.plan = replan(self.cfg, plan, recompute=tuple(report.modes), lengths=self.lengths)
        if plan.tile_tokens and report.tile_tokens is None:
            self.dist.say(f"notice: optimization.tile_tokens={plan.tile_tokens} has no effect: no layer is "
                          f"fully recomputed (gradient_checkpointing: {self.cfg.optimization.gradient_checkpointing})")
        return report

    def _build_optimizer(self):
        from maximus.memory.offload import build_optimizer

        t = self.cfg.training
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
        groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        return build_optimizer(groups, self.plan.optimizer, lr=t.learning_rate, betas=t.betas,
                               weight_decay=t.weight_decay, offload=self.plan.offload_optimizer)


    def _lr_lambda(self, step: int) -> float:
        t = self.cfg.training
        warm = t.warmup_steps if t.warmup_steps >= 1 else round(t.warmup_steps * self.total_steps)
        warm = int(warm)
        if step < warm:
            return (step + 1) / (warm + 1)
        if t.scheduler == "constant":
            return 1.0
        progress = (step - warm) / max(1, self.total_steps - warm)
        progress = min(max(progress, 0.0), 1.0)
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if t.scheduler == "cosine" else 1 - progress
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * decay

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
        batches = obj.step_batches(self, step)  # GRPO samples its own
        if batches is None:
            rows = self.rows_for_step(step)
            if self.plan.micro_batch_tokens:  # by a token budget, longest rows first (same loss: sums / units)
                groups = split_by_tokens([row_length(r) for r in rows], self.plan.micro_batch_tokens)
                chunks = [[rows[i] for i in g] for g in groups]
            else:
                micro = self.plan.micro_batch_size
                chunks = [rows[i:i + micro] for i in range(0, len(rows), micro)]
            batches = [flatten(c) if self._flatten(c) else collate(c, self.tokenizer.pad_token_id) for c in chunks]
        units = self.dist.all_reduce_int(sum(obj.count(b) for b in batches))
        tokens = sum(obj.tokens(b) for b in batches)
        loss_total = torch.zeros((), device=self.device, dtype=torch.float64)
        sums: dict[str, float] = {}
        scale = self.dist.world_size / max(units, 1)
        for i, batch in enumerate(batches):
            batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
            # DDP: gradients are all-reduced once per optimizer step, on the last micro-batch.
            sync = nullcontext() if i == len(batches) - 1 or not hasattr(self.step_module, "no_sync") \
                else self.step_module.no_sync()
            with sync:
                with autocast_for(self.device, self.dtype):
                    loss_sum, metric_sums = self.step_module(batch)
                (loss_sum * scale).backward()
            loss_total += loss_sum.detach().double()
            for k, v in metric_sums.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        obj.after_backward(self, step)  # GRPO: an asynchronous generation finishes before the weights change
        if "after_backward" in self.hooks:
            self.hooks["after_backward"](self, step)
        loss_total = self.dist.all_reduce_sum(loss_total)
        loss = float(loss_total) / max(units, 1)
        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = self.cfg.training.max_grad_norm
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

    # ------------------------------------------------------------------------------ runtime guard
    def _guarded_step(self, step: int, out: ProgressDisplay) -> dict:
        """`train_step`, redone after an out-of-memory error with a smaller plan. The step's rows
        do not change, so neither the effective batch nor the data order does."""
        while True:
            try:
                return self.train_step(step)
            except torch.OutOfMemoryError:
                self.optimizer.zero_grad(set_to_none=True)
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                smaller = self._smaller_plan()
                if smaller is None:
                    raise TrainingError(f"out of memory at step {step} with micro-batch 1 and full recomputation",
                                        "lower training.seq_len, use method: qlora, or set a smaller target_vram "
                                        "so the planner offloads more") from None
                change = self._adopt(smaller, step=step, reason="out of memory")
                out.message(f"warning: out of memory at step {step}; re-planned ({change}) and redoing the step")

    def _check_budget(self, step: int, out: ProgressDisplay) -> None:
        """After a step: when its measured peak (CUDA: max_memory_allocated; CPU: the meter's
        storage tracker) passed the budget, re-plan downward for the next steps. The planner's
        search runs again with its estimate scaled by measured / predicted (whatever the
        estimator missed is taken to grow with it); failing that, the micro-batch halves, then
        every layer recomputes."""
        if not self.meter.over_budget_bytes():
            return
        from maximus.memory.run_plan import plan_below_measured

        budget, measured = int(self.meter.budget_bytes), self.meter.peak_bytes()
        smaller = plan_below_measured(self.cfg, self.plan, measured, budget, lengths=self.lengths) or self._smaller_plan()
        reason = f"measured peak {measured:,} bytes over the budget of {budget:,}"
        change = "nothing left to shrink"
        if smaller is not None:
            change = self._adopt(smaller, step=step, reason=reason, measured_peak_bytes=measured)
        out.message(f"warning: step {step} peaked at {measured:,} bytes, over the budget of {budget:,}; "
                    f"re-planned for the next steps: {change}")

    def _smaller_plan(self):
        """The next cheaper plan, or None: halve the micro-batch (the accumulation doubles), then
        recompute every layer."""
        plan = self.plan
        if plan.micro_batch_tokens and plan.micro_batch_tokens > self.lengths.longest:
            return replan(self.cfg, plan, micro_batch_tokens=max(self.lengths.longest, plan.micro_batch_tokens // 2),
                          lengths=self.lengths)
        if plan.micro_batch_size > 1 and not plan.micro_batch_tokens:
            return replan(self.cfg, plan, micro_batch_size=plan.micro_batch_size // 2, lengths=self.lengths)
        if set(plan.recompute) != {"full"}:
            return replan(self.cfg, plan, recompute=("full",) * len(plan.recompute), lengths=self.lengths)
        return None

    def _adopt(self, new, *, step: int, reason: str, **measured) -> str:
        """Switch to plan `new` between steps (recompute modes on the model, the objective's
        plan), record it in `replans` (run.json) and return what changed."""
        old = self.plan
        if new.recompute != old.recompute or new.offload_activations != old.offload_activations:
            from maximus.memory.checkpointing import apply_checkpointing

            self.checkpointing = apply_checkpointing(self.model, list(new.recompute), micro_batch=new.micro_batch_size,
                                                     seq_len=self.cfg.training.seq_len,
                                                     offload_activations=new.offload_activations,
                                                     tile_tokens=new.tile_tokens)
        self.plan = self.objective.plan = new
        change = _plan_change(old, new)
        self.replans.append({"step": step, "reason": reason, "change": change,
                             "predicted_peak_bytes": new.peak_bytes, **measured})
        self._write_live_plan()
        return change

    def _write_live_plan(self) -> None:
        """output_dir/plan.json: the plan in force while the run goes on (budget, predicted peak,
        re-plans), for live views (`maximus ui`) that cannot wait for run.json. Rewritten atomically."""
        if self.dist.is_main:
            write_json(self.run_dir / "plan.json", {"config": self.cfg.to_dict(), "plan": self.plan.to_dict(),
                                                    "method": self.method, "steps": self.total_steps,
                                                    "replans": self.replans})

    # ------------------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict:
        if not self.cfg.eval.enabled or not (self.data.eval or self.cfg.eval.prompts):
            return {}
        return self.objective.evaluate(self)

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
            with self.dist.session():
                self.objective.prepare(self)  # may write into output_dir (DPO reference cache): after the lock
                summary = self._train(started)
            finished = True
            return summary
        finally:
            if lock:
                lock.release()
            if hasattr(self, "dist"):
                self.dist.shutdown(clean=finished)  # destroys the process group, also after an error

    def _train(self, started: float) -> dict:
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
        self._print_header(out)
        self._write_live_plan()
        # Rank 0 alone owns metrics.jsonl (another rank re-creating it would cut rank 0's file) and the sinks.
        sinks = (open_sinks(cfg.logging, run_dir, resume_step=start_step, budget_bytes=self.plan.budget_bytes,
                            config=cfg.model_dump(mode="json")) if self.dist.is_main else None)
        metrics = MetricsLog(run_dir / "metrics.jsonl", resume_step=start_step, sinks=sinks) if self.dist.is_main else None

        if start_step == 0 and cfg.eval.enabled and cfg.eval.before:
            state["eval_before"] = self.evaluate()
            if sinks:
                sinks.eval("before", 0, state["eval_before"])
            if "loss" in state["eval_before"]:
                out.message(f"base model: held-out loss {state['eval_before']['loss']:.4f}")
        if start_step == 0 and self.tasks is not None and self.tasks.prompted:  # the base, before any step
            state["eval_prompted"] = self.tasks.score_prompted(self.model, device=self.device, dtype=self.dtype,
                                                               batch_size=self.plan.micro_batch_size)
        previous = self._install_signal_handlers()
        bad_in_row = state.get("bad_in_row", 0)
        skipped = state.get("skipped_steps", 0)
        peak = state.get("peak_memory_bytes", 0)
        step = start_step
        try:
            for step in range(start_step + 1, self.total_steps + 1):
                t0 = time.perf_counter()
                self.meter.reset_peak()  # each row's peak_memory_bytes is that step's own peak
                with self.meter.track(self.model, self.optimizer):
                    result = self._guarded_step(step, out)
                elapsed = time.perf_counter() - t0
                peak = max(peak, self.meter.peak_bytes())
                step_peak = self.meter.peak_bytes()
                self._check_budget(step, out)
                row = {"step": step, "loss": result["loss"], "lr": self.scheduler.get_last_lr()[0],
                       "grad_norm": result["grad_norm"], "tokens_per_s": result["tokens"] / max(elapsed, 1e-9),
                       "step_time_s": elapsed, "tokens": result["tokens"], "memory_bytes": self.meter.current_bytes(),
                       "peak_memory_bytes": step_peak, **result["metrics"]}
                if not result["finite"]:
                    bad_in_row += 1
                    skipped += 1
                    row["skipped"] = True
                    out.message(f"warning: step {step} had a non-finite loss or gradient; skipped (no update)")
                    if bad_in_row >= cfg.training.max_bad_steps:
                        if metrics is not None:
                            metrics.write(row)
                        raise TrainingError(f"{bad_in_row} consecutive steps had a non-finite loss or gradient (last: step {step})",
                                            "lower training.learning_rate or check the data; the last good checkpoint is kept")
                else:
                    bad_in_row = 0
                if metrics is not None:
                    metrics.write(row)
                out.update(row)
                state.update(bad_in_row=bad_in_row, skipped_steps=skipped, peak_memory_bytes=peak)
                if cfg.eval.every and step % cfg.eval.every == 0 and step < self.total_steps:
                    ev = self.evaluate()
                    if ev and metrics is not None:
                        metrics.write({"step": step, "eval_loss": ev.get("loss"), "eval_perplexity": ev.get("perplexity")})
                stop = self.dist.any(self._stop_signal is not None)  # every rank stops at the same step
                if step < self.total_steps and ((cfg.training.save_every and step % cfg.training.save_every == 0) or stop):
                    self._save(ckpt_root, step, state)
                if stop:
                    name = signal.Signals(self._stop_signal).name
                    raise Preempted(f"stopped by {name} after step {step}/{self.total_steps}; checkpoint saved in {ckpt_root}",
                                    "re-run the same command to resume")
            self._save(ckpt_root, step, state)
        finally:
            self._restore_signal_handlers(previous)
            if metrics is not None:
                metrics.close()
            if sinks is not None and sys.exc_info()[1] is not None:
                sinks.close()  # a failed or stopped run still ends its W&B / MLflow run
            out.close()
        eval_after = self.evaluate() if cfg.eval.enabled else {}
        if sinks is not None:
            sinks.eval("after", step, eval_after)
            sinks.close()
        if self.dist.is_main:
            self._write_outputs(state, eval_after, peak, skipped, started)
            self._print_summary(state.get("eval_before", {}), eval_after, out)
        return self._summary

    def _save(self, root: Path, step: int, state: dict) -> None:
        # Under FSDP2 every rank helps gather whole tensors; rank 0 alone writes.
        model, optimizer = self.dist.checkpoint_view(self.model, self.optimizer)
        if not self.dist.is_main:
            return
        self._gathered = model if model is not self.model else None  # for _save_final_weights
        save_checkpoint(root, step, model, optimizer, {**state, "scheduler": self.scheduler.state_dict()},
                        keep=self.cfg.training.keep_checkpoints)

    # ------------------------------------------------------------------------------ outputs
    def _write_outputs(self, state: dict, eval_after: dict, peak: int, skipped: int, started: float) -> None:
        run_dir = self.run_dir
        self._save_final_weights(run_dir)
        trainable, total = count_parameters(self.model)
        summary = {
            "config": self.cfg.to_dict(),
            "plan": self.plan.to_dict(),
            "versions": _versions(),
            "device": str(self.device), "dtype": str(self.dtype).replace("torch.", ""),
            "method": self.method,
            "parameters": {"trainable": trainable, "total": total},
            "steps": self.total_steps, "skipped_steps": skipped, "replans": self.replans,
            "wall_time_s": round(time.time() - started, 3),
            "memory": {"peak_bytes": peak, "budget_bytes": self.plan.budget_bytes,
                       "breakdown": self.meter.breakdown(self.model, self.optimizer)},
            "checkpointing": self.checkpointing.to_dict() if hasattr(self.checkpointing, "to_dict") else None,
            "data": self.data.stats,
            "eval": self._eval_summary(state, eval_after),
            "distributed": self.dist.describe(),
            "kernels": self.kernels.to_dict(),
        }
        write_json(run_dir / "run.json", summary)
        try:
            plot_loss(run_dir / "metrics.jsonl", run_dir / "loss.png", title=f"{Path(self.cfg.model).name} ({self.method})",
                      summary=summary)
        except Exception as exc:  # a plot must never fail a finished run
            print(f"warning: could not draw loss.png: {exc}")
        self._summary = summary

    def _eval_summary(self, state: dict, eval_after: dict) -> dict:
        """run.json's `eval`: before, after, and with a prompting baseline `prompted` and `verdict`."""
        from maximus.evaluate.report import verdict

        summary = {"before": state.get("eval_before", {}), "after": eval_after}
        if state.get("eval_prompted"):
            summary["prompted"] = state["eval_prompted"]
            summary["verdict"] = verdict(eval_after, state["eval_prompted"], self.cfg.eval.task_metrics)
        return summary

    def _save_final_weights(self, run_dir: Path) -> None:
        """adapter/ (PEFT) or model/ (full), written beside and renamed into place."""
        if self.streamer is not None:
            self.streamer.remove()
            self.streamer = None
        name = "adapter" if hasattr(self.model, "peft_config") else "model"
        final = run_dir / name
        tmp = run_dir / f".{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        # Under FSDP2 the live parameters are shards: save the whole ones the last _save gathered.
        gathered = getattr(self, "_gathered", None)
        extra = {"state_dict": gathered.tensors} if gathered is not None else {}
        self.model.save_pretrained(str(tmp), safe_serialization=True, **extra)
        self.tokenizer.save_pretrained(str(tmp))
        old = run_dir / f".{name}.old"
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        fsync_dir(run_dir)

    def _print_header(self, out: ProgressDisplay) -> None:
        trainable, total = count_parameters(self.model)
        out.message(f"maximus: {self.cfg.model} | {self.method} | {trainable:,} trainable of {total:,} parameters | "
                    f"{self.device} {str(self.dtype).replace('torch.', '')} | {len(self.data.train)} train rows, "
                    f"{len(self.data.eval)} eval rows | {self.total_steps} steps of {self.cfg.training.batch_size} x "
                    f"{self.cfg.training.seq_len} tokens")
        for line in self.plan.text().splitlines():
            out.message("  " + line)

    def _print_summary(self, before: dict, after: dict, out: ProgressDisplay) -> None:
        from maximus.evaluate.report import summary_lines

        ev = self._summary.get("eval", {})
        lines = summary_lines(before, after, ev.get("prompted"), ev.get("verdict"), metrics=self.cfg.eval.task_metrics,
                              prompts=self.cfg.eval.prompts)
        lines.append(f"run directory: {self.run_dir} (adapter/, run.json, metrics.jsonl, loss.png)")
        for line in lines:
            print(line, flush=True)

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


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover
        pass


def _versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("maximusllm", "torch", "transformers", "peft", "bitsandbytes", "datasets"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def _plan_change(old, new) -> str:
    """What differs between two plans, e.g. ``micro-batch 4 -> 2, checkpointing none -> full``."""
    parts = []
    for label, a, b in (("micro-batch", old.micro_batch_size, new.micro_batch_size),
                        ("micro-batch tokens", old.micro_batch_tokens, new.micro_batch_tokens),
                        ("checkpointing", old.checkpointing_label, new.checkpointing_label),
                        ("activation offload", old.offload_activations, new.offload_activations),
                        ("loss chunk", old.loss_chunk_size, new.loss_chunk_size)):
        if a != b:
            parts.append(f"{label} {a} -> {b}")
    return ", ".join(parts) or "no change"
