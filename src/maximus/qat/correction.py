"""A low-rank correction of the base's own rounding, served beside the adapter (`training.qat_correction_rank`).

Kept apart from the base file (`training.qat_adapter: separate`, `maximus export --format gguf-lora`),
a LoRA layer serves `x Q(W)^T + x (s B A)^T`: the base keeps all of its rounding error `W - Q(W)`,
which a merged file partly breaks up and a rank-r adapter trained for the task mostly cannot make up
for. With `training.qat_correction_rank: N` the run first computes, for every adapted matrix, the
rank-N matrix `L R` closest to `W - Q(W)` in the metric of the inputs the layer sees, as EoRA does
(Liu et al. 2024): with `C = X^T X` the inputs' covariance over the first `CALIBRATION_ROWS` training
rows, `C = U S U^T`, `L R` is the rank-N truncated SVD of `(W - Q(W)) U S^(1/2)` mapped back by
`S^(-1/2) U^T`, which minimises `|| (W - Q(W) - L R) X^T ||` (Eckart-Young). The correction is
frozen: the adapter trains against `Q(W) + L R` (the cached rounded base, so a step costs nothing
more), and the export writes `[s B, L]` and `[A; R]` as one LoRA of rank r + N, which llama.cpp
applies to the rounded base exactly as training did. The run's float model (`adapter/`, the base
in float plus the adapter) does not include it; `adapter/qat_correction.safetensors` holds it.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

#: Training rows whose inputs set each layer's metric.
CALIBRATION_ROWS = 64
#: The run's correction, inside its adapter/ (PEFT ignores it).
CORRECTION_FILE = "qat_correction.safetensors"
#: Covariance bytes (float32) gathered in one pass over the calibration rows; more layers take more passes.
PASS_BYTES = 1 << 30


def correction_factors(error: torch.Tensor, cov: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(L, R), float64, with L @ R the rank-`rank` matrix closest to `error` (rows x columns) in
    || (error - L R) X^T ||_F, where `cov` = X^T X (columns x columns): the truncated SVD of
    error U S^(1/2) (cov = U S U^T), mapped back. L carries the square root of the singular values,
    R the other."""
    c = cov.double() / cov.diagonal().double().mean().clamp_min(1e-30)
    s, u = torch.linalg.eigh(c + 1e-6 * torch.eye(c.shape[0], dtype=c.dtype, device=c.device))
    s = s.clamp_min(1e-10)
    p, sigma, vh = torch.linalg.svd(error.double() @ u * s.sqrt(), full_matrices=False)
    rank = min(rank, sigma.numel())
    root = sigma[:rank].sqrt()
    return p[:, :rank] * root, (root[:, None] * vh[:rank]) / s.sqrt() @ u.T


def calibration_rows(train: list[dict], objective: str, *, asked: str, drop: str) -> list[dict]:
    """The first `CALIBRATION_ROWS` of a run's training rows, whose inputs set each layer's metric.
    ConfigError when they are not token rows (`asked`: what needs them; `drop`: how to do without)."""
    from maximus.errors import ConfigError

    rows = train[:CALIBRATION_ROWS]
    if not rows or "input_ids" not in rows[0]:
        raise ConfigError(f"{asked} needs tokenized training rows to measure the layers' inputs, and the "
                          f"{objective} objective's rows have none", f"use objective sft, or {drop}")
    return rows


def _passes(layers: dict[str, torch.nn.Module]) -> list[list[str]]:
    """The layers split into groups whose float32 covariances fit `PASS_BYTES`, in order."""
    groups, group, size = [], [], 0
    for path, module in layers.items():
        need = module.in_features ** 2 * 4
        if group and size + need > PASS_BYTES:
            groups.append(group)
            group, size = [], 0
        group.append(path)
        size += need
    return groups + ([group] if group else [])


def input_covariances(model, layers: dict[str, torch.nn.Module], rows: list[dict], device) -> dict[str, torch.Tensor]:
    """{path: X^T X (float32, on the CPU)} of the inputs each of `layers` sees over `rows` (each a
    dict with `input_ids`), the model in eval mode and without gradients."""
    found: dict[str, torch.Tensor] = {}
    for group in _passes(layers):
        cov = {p: torch.zeros(layers[p].in_features, layers[p].in_features, device=device) for p in group}

        def hook(path):
            def record(module, inputs, output):
                x = inputs[0].reshape(-1, inputs[0].shape[-1]).float()
                cov[path].addmm_(x.T, x)
            return record

        handles = [layers[p].register_forward_hook(hook(p)) for p in group]
        try:
            with torch.no_grad():
                for row in rows:
                    model(input_ids=torch.tensor([row["input_ids"]], device=device))
        finally:
            for handle in handles:
                handle.remove()
        found.update({p: c.cpu() for p, c in cov.items()})
    return found


def rounding_corrections(model, rows: list[dict], rank: int, apart: dict, device) -> dict:
    """{path: (L, R)} (float32, CPU) for each LoRA layer in `apart` ({path in the causal LM: (its
    base layer, its `_Rounding`)}, `QatReport.apart`): the rank-`rank` correction of the base's
    rounding error in the metric of its inputs over `rows` (the base alone: adapters off, eval mode)."""
    from maximus.qat.install import base_weight

    layers = {p: holder for p, (holder, _) in apart.items()}
    was_training = model.training
    model.eval()
    try:
        with model.disable_adapter():
            cov = input_covariances(model, layers, rows, device)
    finally:
        model.train(was_training)
    factors = {}
    for path, (holder, rounding) in apart.items():
        weight = base_weight(holder).float()
        error = (weight - rounding.rounding(weight)).to(torch.float64)
        left, right = correction_factors(error, cov.pop(path).to(error.device), rank)
        factors[path] = (left.float().cpu(), right.float().cpu())
    return factors


def save_corrections(directory: Path, factors: dict, *, target: str, rank: int) -> None:
    """Write `factors` ({path under the PEFT model: (L, R)}) as `directory/CORRECTION_FILE`."""
    from safetensors.torch import save_file

    tensors = {}
    for path, (left, right) in factors.items():
        tensors[f"{path}.left"] = left.contiguous()
        tensors[f"{path}.right"] = right.contiguous()
    save_file(tensors, str(Path(directory) / CORRECTION_FILE),
              metadata={"maximus": json.dumps({"target": target, "rank": rank})})


def _read_corrections(directory: Path, tensors: bool) -> tuple[dict | None, dict] | None:
    path = Path(directory) / CORRECTION_FILE
    if not path.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {}).get("maximus", "{}"))
        if not tensors:
            return None, meta
        names = sorted({k.rsplit(".", 1)[0] for k in f.keys()})
        return {n: (f.get_tensor(f"{n}.left"), f.get_tensor(f"{n}.right")) for n in names}, meta


def load_corrections(directory: Path) -> tuple[dict, dict] | None:
    """({path: (L, R)}, {"target", "rank"}) from `directory/CORRECTION_FILE`, or None without one."""
    return _read_corrections(directory, tensors=True)


def correction_meta(directory: Path) -> dict | None:
    """{"target", "rank"} of `directory/CORRECTION_FILE` (its header alone), or None without one."""
    found = _read_corrections(directory, tensors=False)
    return None if found is None else found[1]
