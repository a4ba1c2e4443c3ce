"""QLoRA dtype layout (maximus.models.load_model): 4-bit base, fp32 adapters, and under bf16 every
frozen non-quantized weight in bf16 so the residual stream stays bf16 (no per-projection casts)."""
from __future__ import annotations

import pytest
import torch

from maximus import Config
from maximus.models import load_model
from tiny import tiny_config


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_qlora_frozen_weights_follow_the_compute_dtype(dtype, tiny_llama, pc_data, tmp_path):
    cfg = Config.from_dict(tiny_config(tiny_llama, pc_data, tmp_path / "run", method="qlora",
                                       training={"dtype": dtype}))
    model, _ = load_model(cfg, device=torch.device("cpu"), method="qlora")
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    frozen = {n: p.dtype for n, p in model.named_parameters() if not p.requires_grad}
    trainable = {p.dtype for p in model.parameters() if p.requires_grad}
    assert trainable == {torch.float32}  # adapters keep fp32 masters
    assert {d for n, d in frozen.items() if "proj" in n and "lora" not in n} == {torch.uint8}  # NF4 packed
    norms = {d for n, d in frozen.items() if "norm" in n}
    heads = {d for n, d in frozen.items() if "embed_tokens" in n or "lm_head" in n}
    assert heads == {compute}
    assert norms == ({torch.bfloat16} if dtype == "bf16" else {torch.float32})  # fp16 keeps PEFT's fp32 norms
    if dtype == "bf16":
        seen = []
        layer = model.base_model.model.model.layers[0]
        hook = layer.register_forward_hook(lambda m, i, o: seen.append((o[0] if isinstance(o, tuple) else o).dtype))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=torch.tensor([[1, 2, 3]]))
        hook.remove()
        assert seen == [torch.bfloat16]
