"""A Llama-3.1-70B-shaped QLoRA step on one GPU capped at 15 GiB: the 4-bit weights stream.

The process is capped at 15 GiB of device memory (`torch.cuda.set_per_process_memory_fraction`).
A Llama-3.1-70B-shaped model is built layer by layer with random NF4 weights straight into pinned
host memory (`maximus.layerwise_load.random_layerwise_qlora`: no checkpoint, no download; each
layer's 4-bit storages are made on the device, copied to the host store and released before the
next layer exists), LoRA r=16 on every linear layer, full recompute, Maximus' chunked loss, and
`FrozenWeightStreamer` brings each layer's weights one layer ahead on a side stream. It runs
``--steps`` QLoRA steps at ``--seq`` tokens, micro-batch 1, then the same steps with the weights
resident and no cap (the streamer restores every layer; 37 GB fits an H200), and prints, row by
row as each finishes (and appends to ``--out``/giant.jsonl; the table to ``--out``/giant.md):

* ``prediction``: the planner's predicted peak and step time for this run (`estimate_peak` with
  streamed parameters, the card's host-to-device bandwidth in the step-time model);
* ``bandwidth``: a plain pinned host-to-device copy's GB/s, and the streamer's own (every layer
  fetched and released with no compute);
* ``streamed``: peak allocated, step seconds (median of the steps after the first), tokens/s, the
  GB streamed per step and the GB/s that makes;
* ``resident``: the same without the cap and without streaming, and the streamed/resident ratio.

``--dry`` (the CPU rehearsal of `benchmarks/gpu.sh --dry`): the prediction row, then the same
build and steps on a shrunk model (2 layers, hidden 256) on the CPU, then the real run, which stops
at its first CUDA use (`benchmarks/_child.py`).

    python benchmarks/giant.py --out /tmp/giant             # on a GPU with >= 40 GB (for the resident row)
    python benchmarks/giant.py --out /tmp/giant --dry       # CPU: everything up to the first CUDA use
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MODEL = "meta-llama/Llama-3.1-70B"
CAP_GIB = 15
GIB = 2**30


def llama_config(name: str = MODEL, **shrink):
    """The Transformers config of `name`'s published shape (`KNOWN_SHAPES`), optionally shrunk."""
    from transformers import AutoConfig

    from maximus.memory.shape import KNOWN_SHAPES

    fields = {**KNOWN_SHAPES[name], **shrink}
    config = AutoConfig.for_model(**fields)
    config.use_cache = False
    return config


def write_row(out: Path, row: dict) -> None:
    print(json.dumps(row), flush=True)
    with open(out / "giant.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def prediction(seq: int, card: str) -> dict:
    """The planner's figures for the run this script makes: QLoRA r=16 all-linear, bf16, micro-batch 1,
    full recompute, exact chunked loss, AdamW on the adapters, 4-bit weights streamed from host
    memory; tokens/s on `card` (its compute and host-to-device rate, `maximus plan`'s card table)."""
    from maximus.config import GPU_CARDS
    from maximus.memory.coefficients import DEVICE_FLOPS
    from maximus.memory.estimate import estimate_peak
    from maximus.plan_command import CARD_TFLOPS, card_tokens_per_s
    from maximus.memory.planner import plan_for_budget

    est = estimate_peak(MODEL, method="qlora", dtype="bf16", micro_batch=1, seq_len=seq, checkpointing="full",
                        lora_r=16, optimizer="adamw", loss_mode="exact", offload_params="on", device="cuda")
    plan = plan_for_budget(MODEL, None, method="qlora", batch_size=1, seq_len=seq, micro_batch_size=1,
                           gradient_checkpointing="full", offload_activations="off", offload_optimizer="off",
                           tile_tokens="off", lean_lora=False, offload_params="on")
    speed, bound = card_tokens_per_s(plan, CARD_TFLOPS[card] * 1e12 / DEVICE_FLOPS["cuda"], GPU_CARDS[card][2])
    return {"row": "prediction", "card": card, "peak_gib": est.peak_bytes / GIB, "host_gib": est.host_bytes / GIB,
            "streamed_gb_per_step": est.streamed_bytes_per_step / 1e9, "tokens_per_s": speed, "bound": bound}


def build(config, device, store, seq: int):
    """The model (random NF4 layers in `store`), its streamer, the optimizer, and one step function."""
    import torch
    from peft import LoraConfig, get_peft_model

    from maximus.layerwise_load import random_layerwise_qlora
    from maximus.losses.linear_cross_entropy import linear_cross_entropy
    from maximus.memory.checkpointing import apply_checkpointing
    from maximus.memory.weight_streaming import FrozenWeightStreamer

    model = random_layerwise_qlora(config, device=device, dtype=torch.bfloat16, attention="sdpa", store=store)
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # adapters train in fp32, as maximus.models does
    model.train()
    streamer = FrozenWeightStreamer(model, store)
    apply_checkpointing(model, "full", micro_batch=1, seq_len=seq)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    decoder = model.base_model.model.model
    head = model.base_model.model.lm_head
    generator = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (1, seq + 1), generator=generator).to(device)

    def step() -> float:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            hidden = decoder(input_ids=ids[:, :-1]).last_hidden_state
        loss = linear_cross_entropy(hidden, head.weight, ids[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return model, streamer, step


def timed_steps(step, steps: int, device) -> tuple[list[float], list[float]]:
    import torch

    losses, seconds = [], []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(step())
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    return losses, seconds


def steady(seconds: list[float]) -> float:
    return statistics.median(seconds[1:] if len(seconds) > 1 else seconds)


def rehearse_on_cpu(out: Path, seq: int) -> None:
    """The whole path on a shrunk model on the CPU: build, stream, steps, restore, resident steps."""
    import torch

    from maximus.memory.weight_store import HostWeightStore

    config = llama_config(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=512)
    device = torch.device("cpu")
    _, streamer, step = build(config, device, HostWeightStore(pin=False), seq=min(seq, 64))
    losses, seconds = timed_steps(step, 2, device)
    streamer.remove()
    resident, _ = timed_steps(step, 1, device)
    write_row(out, {"row": "cpu rehearsal", "streamed_losses": losses, "resident_loss": resident[0],
                    "most_resident_layers": streamer.stats["most_resident_layers"], "step_s": steady(seconds)})


def pinned_copy_gbps(device, nbytes: int = GIB) -> float:
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return 3 * nbytes / (time.perf_counter() - t0) / 1e9


def streamer_gbps(streamer) -> float:
    """Every layer fetched to the device and released, nothing computed: the streamer's H2D rate."""
    import torch

    torch.cuda.synchronize()
    before, t0 = streamer.stats["streamed_bytes"], time.perf_counter()
    for i in range(len(streamer.layers)):
        streamer._wait(i)
        streamer._release(i - 1)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    streamer._release(len(streamer.layers) - 1)
    return (streamer.stats["streamed_bytes"] - before) / seconds / 1e9


def run_on_gpu(out: Path, seq: int, steps: int) -> list[dict]:
    import torch

    from maximus.memory.weight_store import HostWeightStore

    device = torch.device("cuda")
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(CAP_GIB * GIB / total, device)
    rows = []
    plain = pinned_copy_gbps(device)
    t0 = time.perf_counter()
    store = HostWeightStore(pin=True)
    model, streamer, step = build(llama_config(), device, store, seq)
    build_s = time.perf_counter() - t0
    rows.append({"row": "bandwidth", "plain_pinned_copy_gbps": plain, "streamer_gbps": streamer_gbps(streamer),
                 "build_s": build_s, "host_store_gib": store.nbytes / GIB})
    write_row(out, rows[-1])
    torch.cuda.reset_peak_memory_stats(device)
    streamed_before = streamer.stats["streamed_bytes"]
    losses, seconds = timed_steps(step, steps, device)
    per_step = (streamer.stats["streamed_bytes"] - streamed_before) / steps
    streamed_s = steady(seconds)
    rows.append({"row": "streamed", "cap_gib": CAP_GIB, "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
                 "step_s": streamed_s, "tokens_per_s": seq / streamed_s, "streamed_gb_per_step": per_step / 1e9,
                 "achieved_h2d_gbps": per_step / streamed_s / 1e9, "most_resident_layers":
                 streamer.stats["most_resident_layers"], "losses": losses, "seconds": seconds})
    write_row(out, rows[-1])
    torch.cuda.set_per_process_memory_fraction(1.0, device)
    streamer.remove()  # every layer back on the device: the resident run
    torch.cuda.reset_peak_memory_stats(device)
    losses, seconds = timed_steps(step, steps, device)
    resident_s = steady(seconds)
    rows.append({"row": "resident", "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
                 "step_s": resident_s, "tokens_per_s": seq / resident_s, "streamed_over_resident": streamed_s / resident_s,
                 "losses": losses, "seconds": seconds})
    write_row(out, rows[-1])
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| row | figures |", "|---|---|"]
    for row in rows:
        figures = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
                            if k not in ("row", "losses", "seconds"))
        lines.append(f"| {row['row']} | {figures} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry", action="store_true", help="CPU rehearsal, then stop at the first CUDA use")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--card", default="H200", help="the card whose bandwidth the prediction uses")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [prediction(args.seq, args.card)]
    write_row(args.out, rows[0])
    if args.dry:
        rehearse_on_cpu(args.out, args.seq)
    try:
        rows += run_on_gpu(args.out, args.seq, args.steps)
    finally:
        (args.out / "giant.md").write_text(markdown(rows))
    return 0


if __name__ == "__main__":
    import os

    if "--dry" in sys.argv:
        os.environ.setdefault("MAXIMUS_GPU_DRY", "1")
    from _child import guarded_main

    sys.exit(guarded_main(main))
