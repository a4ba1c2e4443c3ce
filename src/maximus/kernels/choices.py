"""Which of Maximus' kernels a run's step uses, decided once (`decide_kernels`): the planner
estimates with the decision (`maximus.memory.run_spec.RunSpec.kernels`) and `apply_kernels`
installs what it says. Nothing else decides them."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KernelChoices", "decide_kernels"]


@dataclass(frozen=True)
class KernelChoices:
    """Which of Maximus' kernels the step runs: decided once (`decide_kernels`), read by the
    estimator and installed by `maximus.kernels.apply_kernels` as decided."""

    #: The adapters' projections are the lean ones (`maximus.kernels.lean_lora`), else PEFT's.
    lean_lora: bool = False
    #: The RMSNorms are the lean ones (`maximus.kernels.lean_norm`), else Transformers'.
    lean_norm: bool = True
    #: `maximus.kernels.grouped_experts` runs a mixture's experts (CPU only).
    grouped_experts: bool = False


def decide_kernels(*, mode: str, device_type: str, lean_lora: bool, lean_norm: bool,
                   grouped_experts: bool) -> KernelChoices:
    """The one place the kernels are decided: none of them under ``kernels: compile`` (regional
    compilation takes the layers whole), grouped experts on CPU only (where they are measured;
    on CUDA Transformers' grouped_mm stays)."""
    compiled = mode == "compile"
    return KernelChoices(lean_lora=bool(lean_lora) and not compiled, lean_norm=bool(lean_norm) and not compiled,
                         grouped_experts=bool(grouped_experts) and not compiled and device_type == "cpu")
