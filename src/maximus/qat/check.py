"""`training.qat` against the model and the rest of the config, before anything loads: a target
the model's export cannot hold is one line at config time, not a surprise at export."""
from __future__ import annotations

from maximus.errors import ConfigError, ExportError
from maximus.qat.targets import GGUF_TARGETS


def check_qat(cfg, model_config) -> None:
    """Raise ConfigError when `cfg.training.qat` cannot train for its target with this model
    (`model_config`: its Transformers config) and method."""
    target = cfg.training.qat
    if target == "off":
        return
    from maximus.families import FAMILIES

    family = FAMILIES.get(getattr(model_config, "model_type", None))
    if family is not None and family.moe:
        raise ConfigError(f"training.qat: {target} is not available for {family.name}: its fused expert weights are "
                          "not fake-quantized", "set training.qat: off for mixture-of-experts models")
    if cfg.method != "full" and cfg.lora.use_dora:
        raise ConfigError(f"training.qat: {target} does not take lora.use_dora: true (DoRA rescales the merged weight)",
                          "use plain LoRA (lora.use_dora: false) or training.qat: off")
    if target not in GGUF_TARGETS:
        return
    if cfg.training.qat_adapter == "separate":
        if cfg.method == "full":
            raise ConfigError("training.qat_adapter: separate keeps a LoRA adapter beside the base file, and method full "
                              "trains no adapter", "use method lora or qlora, or remove training.qat_adapter")
        if cfg.lora.modules_to_save:
            raise ConfigError(f"training.qat_adapter: separate writes the adapter as a llama.cpp LoRA file, which holds "
                              f"no fully trained modules (lora.modules_to_save: {cfg.lora.modules_to_save})",
                              "remove lora.modules_to_save or use training.qat_adapter: merged")
    if cfg.optimization.kronecker is not None:
        raise ConfigError(f"training.qat: {target} trains for a GGUF export, which a run with Kronecker sketching cannot "
                          "have (llama.cpp has no such attention)", "drop optimization.kronecker_sketching or training.qat")
    from maximus.export.gguf_arch import gguf_arch

    try:
        gguf_arch(model_config)
    except ExportError as exc:
        raise ConfigError(f"training.qat: {target} trains for a GGUF export, and {exc.message}",
                          "use training.qat: int4 or off for this model") from None
