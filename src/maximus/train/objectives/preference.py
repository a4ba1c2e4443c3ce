"""The preference objective (`objective: dpo`): DPO / IPO / hinge / SimPO / ORPO in the trainer.

One micro-batch of N pairs is one forward of 2N rows (chosen rows then rejected rows, padded to
one length by `maximus.data.collate`). Sequence log-probabilities are sums of per-token
`log p(label)` over the answer tokens only (prompt and padding labels are -100), computed by
`maximus.losses.token_outputs.label_log_probs` from the hidden states: no
tokens x vocabulary logits tensor is ever held.

Reference log-probs (for sigmoid / ipo / hinge; SimPO and ORPO need none), never a second model:

- `dpo.reference: adapter_off` (LoRA / QLoRA): the same model under `disable_adapter()` in
  `no_grad`, just before the policy forward of the same micro-batch. The reference is the base
  *without* any adapter, including one loaded with `init_adapter`; to compare against the SFT
  adapter you start from, use `precomputed`.
- `dpo.reference: precomputed` (required for full fine-tuning): `prepare()` runs the model as it
  is before the first step (base, or base + `init_adapter`) over every train and eval pair once
  and writes `output_dir/reference_logps.safetensors`; a resumed or repeated run with the same
  model reuses it. Pairs are keyed by a SHA-1 of their token ids and labels (the batch carries
  no row index), so the same pair always finds its entry whatever the batch order.

Protocol (see `maximus.train.objectives.base.SFTObjective`): `count` = pairs, `loss_sum` = sum of
per-pair losses with metric sums `rewards/chosen`, `rewards/rejected`, `rewards/margin`,
`rewards/accuracy` (the trainer divides them by the pair count), `evaluate` = exact reward
accuracy, margin and loss on the held-out pairs.

The log-probs are exact (`optimization.loss: exact`, or `naive` for the full-logits reference
path). Raises ConfigError: `adapter_off` on a model without an adapter (full fine-tuning);
`optimization.use_ghost_logit` or `optimization.matryoshka` with `objective: dpo` (an
approximate normaliser would bias policy - reference differences; the auxiliary losses are SFT's).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import torch

from maximus.errors import ConfigError
from maximus.memory.plan import Plan
from maximus.train.views import LivePlan, RunView
from maximus.losses.preference import PreferenceLoss, dpo_loss, needs_reference
from maximus.losses.token_outputs import label_log_probs
from maximus.forward import IGNORE_INDEX, hidden_states, output_head, shift_labels, through_head
from maximus.structure import peft_model_of, row_lengths
from maximus.train.objectives.base import Objective

CACHE_FILE = "reference_logps.safetensors"
_CACHE_VERSION = "1"
SIDES = ("chosen", "rejected")


def sequence_logps(model, input_ids: torch.Tensor, position_ids: torch.Tensor | None, labels: torch.Tensor | None,
                   chunk_size: int | None = None, mode: str = "exact", *,
                   target: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log p of each row's labelled tokens [R] float32, labelled token count [R]).

    mode: ``exact`` (chunked, no full logits) or ``naive`` (full logits: the reference path).
    `target`: the labels already shifted (a context-parallel share), instead of `labels`."""
    hidden = hidden_states(model, input_ids, position_ids)
    target = shift_labels(labels, position_ids) if target is None else target

    def logps_of(hidden: torch.Tensor) -> torch.Tensor:
        head = output_head(model)  # read inside: under FSDP2 the sharded head is gathered only for this call
        return label_log_probs(hidden, head.weight, target, bias=head.bias, softcap=head.softcap,
                               ignore_index=IGNORE_INDEX, chunk_size=chunk_size, mode=mode)

    per_token = through_head(model, hidden, logps_of)
    return per_token.sum(dim=-1), (target != IGNORE_INDEX).sum(dim=-1)


def pair_keys(batch: dict) -> list[bytes]:
    """SHA-1 of each pair's unpadded token ids and labels (both sides): its identity in the cache."""
    parts = {}
    for side in SIDES:
        lengths = row_lengths(batch[f"{side}_position_ids"]).tolist()
        ids = batch[f"{side}_input_ids"].cpu()
        labels = batch[f"{side}_labels"].cpu()
        parts[side] = [(ids[i, :n], labels[i, :n]) for i, n in enumerate(lengths)]
    keys = []
    for (ci, cl), (ri, rl) in zip(parts["chosen"], parts["rejected"]):
        h = hashlib.sha1()
        for t in (ci, cl, ri, rl):
            h.update(len(t).to_bytes(8, "little"))
            h.update(t.to(torch.int64).numpy().tobytes())
        keys.append(h.digest())
    return keys


def _concat_sides(batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """chosen rows then rejected rows, as one [2N, T] batch (collate pads both to one length)."""
    return tuple(torch.cat([batch[f"chosen_{k}"], batch[f"rejected_{k}"]]) for k in ("input_ids", "position_ids", "labels"))


class PreferenceObjective(Objective):
    """DPO-family loss on (chosen, rejected) pairs; the trainer normalises by the pair count."""

    name = "dpo"

    def __init__(self, cfg, plan: Plan | LivePlan, pad_token_id: int):
        super().__init__(cfg, plan, pad_token_id)
        opt = cfg.optimization
        self.refuse_ghost_logit("DPO's exact log-probs already hold no full logits")
        if opt.matryoshka is not None:
            raise ConfigError("optimization.matryoshka does not apply to objective dpo",
                              "remove optimization.matryoshka (it is an SFT auxiliary loss)")
        d = cfg.dpo
        self.preference_loss = PreferenceLoss(loss_type=d.loss, beta=d.beta, label_smoothing=d.label_smoothing,
                                              simpo_gamma=d.simpo_gamma, orpo_alpha=d.orpo_alpha)
        self.reference = d.reference if needs_reference(d.loss) else None
        self.cache: dict[bytes, tuple[float, float]] = {}
        self.cache_path: Path | None = None
        self.cache_reused = False
        #: The trainer's `ContextParallel` (training.context_parallel): chosen and rejected rows
        #: are split over its ranks alike; None or degree 1: whole rows.
        self.context_parallel = None

    @property
    def mode(self) -> str:
        """The log-prob pass: ``naive`` (full logits) when the plan says so, else ``exact``."""
        return "naive" if self.plan.loss_mode == "naive" else "exact"

    @property
    def chunk_size(self) -> int | None:
        return self.plan.loss_chunk_size  # read per step: a re-plan may change it

    # ------------------------------------------------------------------------------ protocol
    def count(self, batch: dict) -> int:
        return int(batch["chosen_input_ids"].shape[0])

    def tokens(self, batch: dict) -> int:
        return int(sum(row_lengths(batch[f"{side}_position_ids"]).sum() for side in SIDES))

    def prepare(self, run: RunView) -> None:
        if self.reference == "adapter_off" and peft_model_of(run.model) is None:
            raise ConfigError(f"dpo.reference: adapter_off needs an adapter to switch off, but method is {run.method}",
                              "set dpo.reference: precomputed (reference log-probs computed once and cached)")
        if self.reference == "precomputed":
            self._prepare_cache(run)

    def loss_sum(self, model, batch: dict) -> tuple[torch.Tensor, dict]:
        losses, chosen_rewards, rejected_rewards, _ = self._pair_losses(model, batch, split=True)
        return losses.sum(), _reward_sums(chosen_rewards, rejected_rewards)

    @torch.no_grad()
    def evaluate(self, run: RunView) -> dict:
        """Held-out pairs: mean loss, reward accuracy (chosen reward > rejected), mean rewards and
        margin, and the perplexity of the chosen answers under the model (per token)."""
        from maximus.data import collate
        from maximus.forward import autocast_for

        model, rows = run.model, run.data.eval
        size = self.plan.micro_batch_size
        max_batches = self.cfg.eval.max_batches
        totals = {"loss": 0.0, "rewards/chosen": 0.0, "rewards/rejected": 0.0, "rewards/margin": 0.0,
                  "rewards/accuracy": 0.0}
        nll, nll_tokens, pairs = 0.0, 0, 0
        was_training = model.training
        model.eval()
        try:
            for i, start in enumerate(range(0, len(rows), size)):
                if max_batches is not None and i >= max_batches:
                    break
                batch = {k: v.to(run.device) for k, v in collate(rows[start:start + size], self.pad_token_id).items()}
                with autocast_for(run.device, run.dtype):
                    losses, rc, rr, (logps, counts) = self._pair_losses(model, batch)
                n = losses.shape[0]
                totals["loss"] += float(losses.double().sum())
                for k, v in _reward_sums(rc, rr).items():
                    totals[k] += float(v)
                nll -= float(logps[:n].double().sum())
                nll_tokens += int(counts[:n].sum())
                pairs += n
        finally:
            model.train(was_training)
        result = {}
        if pairs:
            result = {k: v / pairs for k, v in totals.items()}
            result.update(perplexity=math.exp(min(nll / max(nll_tokens, 1), 50.0)), pairs=pairs)
        if self.cfg.eval.prompts:
            from maximus.evaluate import generate_text

            result["generations"] = generate_text(model, run.tokenizer, self.cfg.eval.prompts, device=run.device,
                                                  max_new_tokens=self.cfg.eval.max_new_tokens)
        return result

    # ------------------------------------------------------------------------------ internals
    def _pair_losses(self, model, batch: dict, *, split: bool = False):
        """Per-pair losses [N], rewards [N] x 2, and the policy's (logps [2N], token counts [2N]).
        `split` (training): under context parallelism each rank runs its share of every row and
        the sequence sums are summed over the ranks, so every rank holds the whole pair losses."""
        n = self.count(batch)
        input_ids, position_ids, labels = _concat_sides(batch)
        cp = self.context_parallel if split and self.context_parallel is not None and self.context_parallel.split.enabled \
            else None
        if cp is None:
            def logps_of_rows():
                return sequence_logps(model, input_ids, position_ids, labels, self.chunk_size, self.mode)
        else:
            share = cp.share_rows(input_ids, labels, position_ids, self.pad_token_id)
            cp.attend(share.get("document_ids"))

            def logps_of_rows():
                logps, counts = sequence_logps(model, share["input_ids"], share["position_ids"], None, self.chunk_size,
                                               self.mode, target=share["shift_labels"])
                return cp.sum_over_row(logps), cp.sum_over_row(counts)
        ref_chosen = ref_rejected = None
        if self.reference == "adapter_off":
            # Before the policy forward, so its activations are gone before the policy's are made.
            with torch.no_grad(), peft_model_of(model).disable_adapter():
                ref, _ = logps_of_rows()
            ref_chosen, ref_rejected = ref[:n], ref[n:]
        elif self.reference == "precomputed":
            ref_chosen, ref_rejected = self._lookup(batch)
        logps, counts = logps_of_rows()
        losses, rc, rr = dpo_loss(logps[:n], logps[n:], ref_chosen, ref_rejected, self.preference_loss,
                                  reduction="none", chosen_lengths=counts[:n], rejected_lengths=counts[n:])
        return losses, rc, rr, (logps.detach(), counts)

    def _lookup(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        keys = pair_keys(batch)
        missing = sum(k not in self.cache for k in keys)
        if missing:  # a bug, not a user mistake: prepare() covers every train and eval pair
            raise RuntimeError(f"{missing} pair(s) of the batch have no precomputed reference log-probs")
        values = torch.tensor([self.cache[k] for k in keys], dtype=torch.float64,
                              device=batch["chosen_input_ids"].device)
        return values[:, 0], values[:, 1]

    def _cache_meta(self, run: RunView) -> dict:
        cfg = self.cfg
        return {"version": _CACHE_VERSION, "model": str(cfg.model), "init_adapter": str(cfg.init_adapter),
                "method": str(run.method), "dtype": str(run.dtype), "mode": self.mode}

    def _prepare_cache(self, run: RunView) -> None:
        from maximus.data import collate
        from maximus.forward import autocast_for

        rows = list(run.data.train) + list(run.data.eval)
        size = self.plan.micro_batch_size
        batches = [collate(rows[i:i + size], self.pad_token_id) for i in range(0, len(rows), size)]
        keys = [k for b in batches for k in pair_keys(b)]
        self.cache_path = Path(run.run_dir) / CACHE_FILE
        meta = self._cache_meta(run)
        stored = _read_cache(self.cache_path, meta)
        if stored is not None and all(k in stored for k in keys):
            self.cache, self.cache_reused = stored, True
            return
        model = run.model
        was_training = model.training
        model.eval()
        values = []
        try:
            with torch.no_grad():
                for batch in batches:
                    batch = {k: v.to(run.device) for k, v in batch.items()}
                    with autocast_for(run.device, run.dtype):
                        logps, _ = sequence_logps(model, *_concat_sides(batch), chunk_size=self.chunk_size, mode=self.mode)
                    n = self.count(batch)
                    values.extend(zip(logps[:n].double().tolist(), logps[n:].double().tolist()))
        finally:
            model.train(was_training)
        self.cache = dict(zip(keys, values))
        if run.dist.is_main:
            _write_cache(self.cache_path, self.cache, meta)


def _reward_sums(chosen: torch.Tensor, rejected: torch.Tensor) -> dict:
    """Per-micro-batch sums; the trainer divides by the step's pair count."""
    chosen, rejected = chosen.double(), rejected.double()
    return {"rewards/chosen": chosen.sum(), "rewards/rejected": rejected.sum(),
            "rewards/margin": (chosen - rejected).sum(),
            "rewards/accuracy": (chosen > rejected).double().sum()}


def _read_cache(path: Path, meta: dict) -> dict | None:
    """{key: (chosen, rejected)} from a cache written for the same model setup, else None."""
    from safetensors import safe_open

    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get("setup") != json.dumps(meta, sort_keys=True):
                return None
            keys, values = f.get_tensor("keys"), f.get_tensor("logps")
    except Exception:  # a torn or foreign file is recomputed, never trusted
        return None
    return {bytes(k.tolist()): (float(v[0]), float(v[1])) for k, v in zip(keys, values)}


def _write_cache(path: Path, cache: dict, meta: dict) -> None:
    """keys: uint8 [P, 20] SHA-1 of each pair; logps: float64 [P, 2] (chosen, rejected) in nats."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    keys = torch.tensor([list(k) for k in cache], dtype=torch.uint8).reshape(-1, 20)
    values = torch.tensor(list(cache.values()), dtype=torch.float64).reshape(-1, 2)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file({"keys": keys, "logps": values}, str(tmp), metadata={"setup": json.dumps(meta, sort_keys=True)})
    os.replace(tmp, path)  # atomic: a crash leaves the old file or none, never half of one

