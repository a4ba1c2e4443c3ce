"""What a run writes and prints besides its checkpoints: the live plan.json, the header and the
before/after table on the terminal, data_report.json, and at the end the final weights
(`adapter/` or `model/`), run.json, data_lengths.png and loss.png; all read the run through a
`maximus.train.views.OutputsView`, never the trainer.
"""
from __future__ import annotations

import platform
import time
from pathlib import Path

from maximus.models import count_parameters
from maximus.files import write_json
from maximus.train.progress import ProgressDisplay, plot_loss
from maximus.train.run_directory import replace_final_weights
from maximus.train.views import OutputsView
from maximus.vision import is_vision_config


def write_live_plan(run: OutputsView) -> None:
    """output_dir/plan.json: the plan in force while the run goes on (budget, predicted peak,
    re-plans), for live views (`maximus ui`) that cannot wait for run.json. Rewritten atomically."""
    if run.dist.is_main:
        write_json(run.run_dir / "plan.json", {"config": run.cfg_as_written.to_dict(), "plan": run.plan.to_dict(),
                                               "method": run.method, "steps": run.total_steps,
                                               "replans": run.live.replans})


def write_data_report(run: OutputsView) -> None:
    """output_dir/data_report.json: every check with its rows, and the template preview (rank 0,
    when the data was checked). data_lengths.png is drawn at the end, with loss.png
    (`plot_data_lengths`): matplotlib stays out of the start-up."""
    if run.data_report is not None and run.dist.is_main:
        write_json(run.run_dir / "data_report.json", run.data_report.to_dict())


def plot_data_lengths(run: OutputsView) -> None:
    """output_dir/data_lengths.png: the training documents' token lengths against seq_len."""
    report = run.data_report
    if report is None:
        return
    from maximus.data.length_plot import plot_lengths

    try:
        plot_lengths(report.lengths, report.seq_len, run.run_dir / "data_lengths.png",
                     title=f"{Path(run.cfg.model).name}: tokens per training document")
    except Exception as exc:  # a plot must never fail a finished run
        print(f"warning: could not draw data_lengths.png: {exc}")


def write_outputs(run: OutputsView, state: dict, eval_after: dict, peak: int, skipped: int, started: float) -> dict:
    """The final weights, run.json and loss.png; returns the run summary (run.json's content)."""
    run_dir = run.run_dir
    save_final_weights(run)
    trainable, total = count_parameters(run.model)
    checkpointing = run.live.checkpointing
    summary = {
        "config": run.cfg_as_written.to_dict(),
        "plan": run.plan.to_dict(),
        "versions": versions(),
        "device": str(run.device), "dtype": str(run.dtype).replace("torch.", ""),
        "method": run.method,
        "parameters": {"trainable": trainable, "total": total},
        "steps": run.total_steps, "skipped_steps": skipped, "replans": run.live.replans,
        "wall_time_s": round(time.time() - started, 3),
        "memory": {"peak_bytes": peak, "budget_bytes": run.plan.budget_bytes,
                   "breakdown": run.meter.breakdown(run.model, run.optimizer)},
        "checkpointing": checkpointing.to_dict() if hasattr(checkpointing, "to_dict") else None,
        "data": run.data.stats,
        "data_check": run.data_report.summary() if run.data_report else None,
        "eval": eval_summary(run.cfg, state, eval_after),
        "distributed": run.dist.describe(),
        "kernels": run.kernels.to_dict(),
    }
    write_json(run_dir / "run.json", summary)
    plot_data_lengths(run)
    try:
        plot_loss(run_dir / "metrics.jsonl", run_dir / "loss.png", title=f"{Path(run.cfg.model).name} ({run.method})",
                  summary=summary)
    except Exception as exc:  # a plot must never fail a finished run
        print(f"warning: could not draw loss.png: {exc}")
    return summary


def eval_summary(cfg, state: dict, eval_after: dict) -> dict:
    """run.json's `eval`: before, after, and with a prompting baseline `prompted` and `verdict`."""
    from maximus.evaluate.report import verdict
    from maximus.evaluate.tasks import task_metrics

    summary = {"before": state.get("eval_before", {}), "after": eval_after}
    if state.get("eval_prompted"):
        summary["prompted"] = state["eval_prompted"]
        summary["verdict"] = verdict(eval_after, state["eval_prompted"], task_metrics(cfg.eval))
    return summary


def _qat_corrections(run: OutputsView) -> dict | None:
    """The run's corrections of the base's rounding (training.qat_correction_rank), for adapter/."""
    if not run.cfg.training.qat_correction_rank:
        return None
    from maximus.qat.install import corrections_of

    return corrections_of(run.model)


def save_final_weights(run: OutputsView) -> None:
    """adapter/ (PEFT; with its qat_correction.safetensors under training.qat_correction_rank) or
    model/ (full), written beside and renamed into place; a previous one is
    replaced only while it holds nothing but what a run wrote (`replace_final_weights`)."""
    model = run.model
    name = "adapter" if hasattr(model, "peft_config") else "model"
    streamer = run.streamer
    if streamer is not None and name == "model":
        # A whole model is saved with its weights in place; an adapter never reads the streamed
        # base (which may not fit the device at once).
        streamer.remove()
        streamer = None
    # Under FSDP2 the live parameters are shards: save the whole ones the last checkpoint gathered.
    gathered = run.gathered
    extra = {"state_dict": gathered.tensors} if gathered is not None else {}
    if streamer is not None and not extra:
        # PEFT picks the adapter out of the whole state dict, and a 4-bit weight's state dict reads
        # its quantization state, which a streamed layer does not hold on the device: hand it the
        # tensors by name instead (the ones it keeps are on the device).
        extra = {"state_dict": {k: v.detach() for named in (model.named_parameters(remove_duplicate=False),
                                                           model.named_buffers(remove_duplicate=False))
                                for k, v in named}}

    corrections = _qat_corrections(run) if name == "adapter" else None

    def save(tmp: Path) -> None:
        model.save_pretrained(str(tmp), safe_serialization=True, **extra)
        run.tokenizer.save_pretrained(str(tmp))
        if corrections:
            from maximus.qat.correction import save_corrections

            save_corrections(tmp, corrections, target=run.cfg.training.qat, rank=run.cfg.training.qat_correction_rank)
        if is_vision_config(model.config):  # the processor (image processor + template) travels with the weights
            from maximus.vision import load_processor

            cfg = run.cfg
            load_processor(cfg.tokenizer or cfg.model, cfg.trust_remote_code).save_pretrained(str(tmp))

    replace_final_weights(run.run_dir, name, save)


def print_header(run: OutputsView, out: ProgressDisplay) -> None:
    """The run's first lines: model, method, parameters, device, data, steps, then the plan."""
    cfg = run.cfg
    trainable, total = count_parameters(run.model)
    out.message(f"maximus: {cfg.model} | {run.method} | {trainable:,} trainable of {total:,} parameters | "
                f"{run.device} {str(run.dtype).replace('torch.', '')} | {len(run.data.train)} train rows, "
                f"{len(run.data.eval)} eval rows | {run.total_steps} steps of {cfg.training.batch_size} x "
                f"{cfg.training.seq_len} tokens")
    for line in run.plan.text().splitlines():
        out.message("  " + line)


def print_summary(run: OutputsView, summary: dict, before: dict, after: dict) -> None:
    """The before/after (and prompted) table of the held-out metrics, the generations, the run
    directory; `summary`: what `write_outputs` wrote to run.json."""
    from maximus.evaluate.report import summary_lines
    from maximus.evaluate.tasks import task_metrics

    ev = summary.get("eval", {})
    lines = summary_lines(before, after, ev.get("prompted"), ev.get("verdict"), metrics=task_metrics(run.cfg.eval),
                          prompts=run.cfg.eval.prompts)
    lines.append(f"run directory: {run.run_dir} (adapter/, run.json, metrics.jsonl, loss.png)")
    for line in lines:
        print(line, flush=True)


def versions() -> dict:
    """Python and the library versions a run records in run.json."""
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("maximusllm", "torch", "transformers", "peft", "bitsandbytes", "datasets"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out
