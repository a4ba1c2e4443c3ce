"""The plan of a run: one typed, immutable object from the planner to everything below it.

`Plan` is what `maximus.memory.plan_run` (config -> plan) and `plan_for_budget` (the search)
return, and what the trainer, the objectives and `DistEnv` read, by attribute. A change of plan
during a run (`maximus.memory.replan`) is a new `Plan`, never an edit of this one.

Recompute has one vocabulary, per decoder layer: ``none`` (autograd keeps everything),
``selective`` (per-op: matmul and attention outputs kept) or ``full`` (the layer input only),
the modes of `maximus.memory.checkpointing`.

`Plan.to_dict` is for run.json only (``plan.peak_bytes`` is the prediction scripts compare with
the measured ``memory.peak_bytes``); `Plan.table` / `Plan.text` are the one rendering of a plan,
for `maximus-train` and `maximus plan` alike.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from maximus.config import format_bytes

__all__ = ["Attention", "Plan", "recompute_label", "BREAKDOWN_ROWS", "RECOMPUTE_MODES", "RECOMPUTE_WORDS", "STRATEGIES"]

BREAKDOWN_ROWS = ("weights", "adapters", "gradients", "optimizer", "activations", "loss", "workspace")

#: Per-layer recompute modes: the one vocabulary from the config (`optimization.gradient_checkpointing`)
#: through the planner, the estimator and `maximus.memory.checkpointing` to run.json.
RECOMPUTE_MODES = ("none", "selective", "full")

#: The words a recompute mode may be written as: the modes, and ``off``, the config's former word
#: for ``none`` (still read: configs written with it keep working).
RECOMPUTE_WORDS = {"none": "none", "off": "none", "selective": "selective", "full": "full"}

#: How the ranks hold the model: one process, every rank whole (DDP), or sharded (FSDP2).
STRATEGIES = ("single", "ddp", "fsdp")


def recompute_label(modes) -> str:
    """Per-layer recompute modes in a few words: ``none``, ``full``, or ``full 3/8 layers``."""
    modes = list(modes)
    kinds = set(modes)
    if len(kinds) == 1:
        return modes[0]
    return ", ".join(f"{m} {modes.count(m)}/{len(modes)} layers" for m in ("full", "selective") if m in kinds)


def plan_summary(p: dict[str, Any]) -> str:
    """`Plan.summary` of a plan as `Plan.to_dict` wrote it (plan.json, run.json, `maximus plan --json`);
    a plan written before `checkpointing_label` existed is labelled from its recompute modes."""
    label = p.get("checkpointing_label") or recompute_label(p.get("recompute") or ("none",))
    offload = "+".join(n for n, k in (("act", "offload_activations"), ("opt", "offload_optimizer"),
                                      ("params" + ("(disk)" if p.get("params_store") == "disk" else ""),
                                       "offload_params")) if p.get(k))
    return (f"{p.get('method')} mb {p.get('micro_batch_size')} x acc {p.get('grad_accum')}, ckpt {label}"
            + (f", offload {offload}" if offload else "") + (f", tiles {p['tile_tokens']}" if p.get("tile_tokens") else "")
            + (f", context parallel {p['context_parallel']}" if (p.get("context_parallel") or 1) > 1 else ""))


def streaming_summary(bytes_per_step: int, compute_tokens_per_s: float, tokens_per_s: float) -> str:
    """One line on streamed weights: the bytes copied per micro-step and whether the copies or the
    compute set the step time (they overlap), with the tokens/s that gives."""
    bound = "transfer-bound" if tokens_per_s < compute_tokens_per_s else "compute-bound"
    return (f"{format_bytes(bytes_per_step)} copied to the device per micro-step; {bound}, "
            f"~{tokens_per_s:,.0f} tokens/s (compute alone: ~{compute_tokens_per_s:,.0f})")


@dataclass(frozen=True)
class Attention:
    """The attention a run trains with: ``sdpa`` (exact) or ``kronecker`` (detail + sketch,
    `maximus.attention`) with its settings (tokens, slots, query block)."""

    kind: str = "sdpa"
    detail_tokens: int | None = None
    sketch_slots: int | None = None
    block: int | None = None

    def label(self) -> str:
        if self.kind != "kronecker":
            return self.kind
        return f"kronecker (detail {self.detail_tokens} tokens, {self.sketch_slots} sketch slots, block {self.block})"


@dataclass(frozen=True)
class Plan:
    """A run's memory plan: the settings chosen and the predicted peak (bytes) of one step.

    ``recompute`` has one mode per decoder layer. ``peak_phase`` is the part of the step where
    the predicted peak falls (``loss``, ``backward`` or ``optimizer``). ``budget_bytes`` is the
    user's ``target_vram``, which the run is held to; without one the plan is fitted to the
    device's free memory (``free_memory_bytes``) and the run is not held to it.

    A plan the estimator could not make (no ``target_vram`` and an architecture it cannot read)
    has ``peak_bytes`` None and no ``recompute`` until the trainer applies the config's policy to
    the loaded model.
    """

    method: str
    micro_batch_size: int
    grad_accum: int
    recompute: tuple[str, ...]
    offload_activations: bool
    offload_optimizer: bool
    optimizer: str
    loss_mode: str
    loss_chunk_size: int | None
    peak_bytes: int | None
    breakdown: Mapping[str, int]
    budget_bytes: int | None
    margin_bytes: int
    peak_phase: str = "loss"
    seq_len: int = 2048
    world_size: int = 1
    dtype: str = "bf16"
    lora_r: int | None = 16
    device: str = "cuda"
    strategy: str = "single"
    objective: str = "sft"
    attention: Attention = field(default_factory=Attention)
    ghost_candidates: int | None = None
    offload_params: bool = False
    #: Where streamed frozen weights live (``offload_params``): ``host`` (pinned memory) or ``disk``
    #: (a file under $MAXIMUS_CACHE), the file's bytes, the bytes copied to the device per
    #: micro-step, and the tokens/s of the compute alone (`tokens_per_s_guess` also counts the
    #: copies: whichever is slower sets the step).
    params_store: str = "host"
    disk_bytes: int = 0
    streamed_bytes_per_step: int = 0
    compute_tokens_per_s: float = 0.0
    tile_tokens: int | None = None
    free_memory_bytes: int | None = None
    generation: Mapping[str, int] | None = None
    tokens_per_s_guess: float = 0.0
    notes: tuple[str, ...] = ()
    #: Host memory the offloading fills (checkpointed layer inputs, optimizer state and masters,
    #: streamed frozen weights), and the available host memory the plan was checked against
    #: (None: not checked, e.g. a prediction for a card on another machine).
    host_bytes: int = 0
    host_budget_bytes: int | None = None
    #: The lengths the plan assumed, read from the data (None: every row at ``seq_len``): the
    #: longest row (tokens; a DPO or contrastive pair: its longer side; GRPO: the longest prompt
    #: + ``max_completion_tokens``) and the tokens of the largest micro-batch the loader forms
    #: (padding included; per side of a pair). ``seq_len`` is then the tokens per row the estimate
    #: was given (``micro_batch_tokens_max / micro_batch_size``, rounded up).
    rows_tokens_max: int | None = None
    micro_batch_tokens_max: int | None = None
    #: Token-budget micro-batches (``training.micro_batch_tokens``): each step's ``rows_per_step``
    #: rows (per rank) are split by `maximus.memory.lengths.split_by_tokens` into micro-batches of
    #: at most this many padded tokens; ``micro_batch_size`` is then the most rows one holds and
    #: ``grad_accum`` the most micro-batches one step has. None: ``micro_batch_size`` rows each.
    micro_batch_tokens: int | None = None
    rows_per_step: int | None = None
    #: Processes that share each row (``training.context_parallel``, or the planner's choice
    #: under ``auto``): each holds ``seq_len / context_parallel`` tokens of a row, and the peak
    #: is one such process's. ``world_size`` counts the ranks that split the batch; the trainer
    #: joins its context-parallel group at this degree.
    context_parallel: int = 1
    #: The run the plan was estimated for (`maximus.memory.run_spec.RunSpec`: the model's shape,
    #: the run's fixed settings, its search space and the data's lengths), so a re-plan needs
    #: neither the config nor the model again; None for a plan made without an estimate. Not
    #: part of run.json nor of equality.
    spec: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "recompute", tuple(self.recompute))
        object.__setattr__(self, "notes", tuple(self.notes))
        object.__setattr__(self, "breakdown", dict(self.breakdown))
        bad = [m for m in self.recompute if m not in RECOMPUTE_MODES]
        if bad:
            raise ValueError(f"recompute modes must be {', '.join(RECOMPUTE_MODES)}, got {bad[0]!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")

    @property
    def effective_batch(self) -> int:
        """Sequences per optimizer step over all ranks."""
        if self.micro_batch_tokens:
            return self.rows_per_step * self.world_size
        return self.micro_batch_size * self.grad_accum * self.world_size

    @property
    def checkpointing_label(self) -> str:
        """``none``, ``full``, ``selective``, ``by measured cost`` or e.g. ``full 3/8 layers``."""
        if not self.recompute:
            return "not planned yet (the config's policy, applied to the loaded model)"
        return recompute_label(self.recompute)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, for run.json (``plan``); lists for tuples, the attention as a mapping."""
        d: dict[str, Any] = {}
        for f in fields(self):
            if f.name == "spec":
                continue
            value = getattr(self, f.name)
            if isinstance(value, Attention):
                value = {k.name: getattr(value, k.name) for k in fields(value)}
            elif isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, Mapping):
                value = dict(value)
            d[f.name] = value
        d["effective_batch"] = self.effective_batch
        d["checkpointing_label"] = self.checkpointing_label
        return d

    # ------------------------------------------------------------------------------ rendering
    def table(self, title: str = "memory plan"):
        """A rich Table: the plan's settings and its memory breakdown against the budget."""
        from rich.table import Table

        t = Table(title=title, show_header=True, header_style="bold")
        t.add_column("item")
        t.add_column("value", justify="right")
        for label, value in self.rows():
            t.add_row(label, value)
        return t

    def summary(self) -> str:
        """The plan in one line, as `maximus plan`'s per-card table and `maximus ui` say it, e.g.
        ``qlora mb 1 x acc 8, ckpt selective, offload act``."""
        return plan_summary(self.to_dict())

    def text(self) -> str:
        """The same as `table`, as plain lines (logs, non-terminal output)."""
        rows = self.rows()
        width = max(len(r[0]) for r in rows)
        return "\n".join(f"{label.ljust(width)}  {value}" for label, value in rows)

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) rows: the settings, the breakdown, the peak and its phase, the budget."""
        host_is_device = self.device == "cpu"
        offload = ", ".join(n for n, on in (("activations", self.offload_activations),
                                            ("optimizer", self.offload_optimizer),
                                            ("frozen weights" + (" (from disk)" if self.params_store == "disk"
                                                                 else ""), self.offload_params)) if on)
        if host_is_device:
            offload = (f"{offload} (no effect on CPU: " if offload else "does not apply (CPU: ") + \
                "host and device memory are the same)"
        details = [f"chunk {self.loss_chunk_size} tokens"] if self.loss_chunk_size else []
        if self.loss_mode == "ghost" and self.ghost_candidates:
            details.append(f"{self.ghost_candidates} candidates")
        loss = self.loss_mode + (f" ({', '.join(details)})" if details else "")
        ranks = f"{self.world_size} rank" + ("s" if self.world_size > 1 else "")
        rows = [
            ("method", self.method + (f" (r={self.lora_r})" if self.method != "full" and self.lora_r else "")),
            ("objective", self.objective),
            ("batch", (f"micro-batches of up to {self.micro_batch_tokens} tokens (up to {self.micro_batch_size} rows, "
                       f"{self.grad_accum} per step) x {ranks}" if self.micro_batch_tokens else
                       f"{self.micro_batch_size} x {self.grad_accum} accumulation x {ranks}")
                      + f" = {self.effective_batch} sequences of " + (f"{self.seq_len} tokens" if self.rows_tokens_max is None
                      else f"up to {self.rows_tokens_max} tokens (the data's longest row)")),
            ("distributed", self.strategy),
            *([("context parallel", f"{self.context_parallel} processes share each row "
                                    f"({self.seq_len // self.context_parallel:,} tokens each)")]
              if self.context_parallel > 1 else []),
            ("checkpointing", self.checkpointing_label + (f", MLP in tiles of {self.tile_tokens} tokens"
                                                           if self.tile_tokens else "")),
            ("offload", offload or "none"),
            ("attention", self.attention.label()),
            ("loss", loss),
            ("optimizer", self.optimizer),
        ]
        rows += [(name, format_bytes(self.breakdown.get(name, 0))) for name in BREAKDOWN_ROWS]
        rows.append(("margin", format_bytes(self.margin_bytes)))
        if self.peak_bytes is None:
            rows.append(("predicted peak", "none: the estimator cannot read this architecture"))
        else:
            rows.append(("predicted peak", f"{format_bytes(self.peak_bytes)} (in the {self.peak_phase} phase)"))
        if self.generation:
            rows.append(("generation", f"{format_bytes(self.generation['total'])} (GRPO sampling: KV cache "
                                       f"{format_bytes(self.generation['kv_cache'])})"))
        if self.host_bytes and not host_is_device:
            checked = (f" of {format_bytes(self.host_budget_bytes)} available" if self.host_budget_bytes
                       else ": not checked against this machine's RAM")
            rows.append(("host memory", f"{format_bytes(self.host_bytes)} for offloaded state{checked}"))
        if self.disk_bytes and not host_is_device:
            rows.append(("disk", f"{format_bytes(self.disk_bytes)} for the streamed layers (a file under the cache)"))
        if self.streamed_bytes_per_step and not host_is_device:
            rows.append(("streaming", streaming_summary(self.streamed_bytes_per_step, self.compute_tokens_per_s,
                                                        self.tokens_per_s_guess)))
        if self.free_memory_bytes:
            rows.append(("free memory", f"{format_bytes(self.free_memory_bytes)} (no target_vram: fitted to it, "
                                        "not held to it)"))
        if self.budget_bytes and self.peak_bytes is not None:
            rows.append(("budget", f"{format_bytes(self.budget_bytes)} "
                                   f"({(self.peak_bytes + self.margin_bytes) / self.budget_bytes:.0%} used with margin)"))
        for note in self.notes:
            rows.append(("note", note))
        return rows
