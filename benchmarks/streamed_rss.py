"""Peak resident memory of a QLoRA step whose 4-bit layers stream from disk, beside host memory and resident.

A Llama-shaped model with random NF4 weights (`maximus.layerwise_load.random_layerwise_qlora`:
built layer by layer, no checkpoint) trains one QLoRA step (LoRA r=8 on every linear layer,
forward + backward + AdamW, bf16; `--rank`) on the CPU, in a fresh process per mode:

* ``resident``: every layer's 4-bit weights in memory (the streamer restores them all first);
* ``on``: ``offload.params: on``, the layers in host memory, streamed one layer ahead;
* ``disk``: ``offload.params: disk``, the layers in a memory-mapped file, streamed one layer ahead.

Each child resets its peak resident set (``/proc/self/clear_refs``) after its imports and reports
``VmHWM`` after the step: the peak RSS of building and training, and the baseline (the process
after imports) beside it (with glibc's mmap threshold fixed at 1 MiB: `MMAP_THRESHOLD`). On the CPU the device is the host, so ``on`` holds the layers twice at
first (the store and the model), then once; ``disk`` holds at most three layers and lets the page
cache serve the file.

    nice python benchmarks/streamed_rss.py                       # 12 layers, hidden 4096: 1.4 GiB of 4-bit layers
    python benchmarks/streamed_rss.py --layers 8 --hidden 1024   # small (seconds)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MODES = ("resident", "on", "disk")
GIB = 2**30
#: glibc serves allocations above this from mmap and returns them when freed. Left dynamic, its
#: threshold climbs to 32 MiB as the step frees large temporaries (each dequantized weight), and the
#: freed heap it then keeps shows in the peak RSS as if it were live: a fixed 1 MiB keeps the figure
#: to what is live (measured: 16 layers, 341 MiB of 4-bit layers, disk mode: 710 MiB of growth
#: with the dynamic threshold, 253 MiB with 1 MiB).
MMAP_THRESHOLD = 2**20


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def child(mode: str, layers: int, hidden: int, intermediate: int, seq: int, cache: Path, vocab: int = 8192,
          rank: int = 8) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig

    from maximus.layerwise_load import random_layerwise_qlora
    from maximus.memory.weight_store import DiskWeightStore, HostWeightStore
    from maximus.memory.weight_streaming import FrozenWeightStreamer

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=hidden // 128, num_key_value_heads=max(1, hidden // 1024),
                         max_position_embeddings=4096, tie_word_embeddings=False, use_cache=False)
    Path("/proc/self/clear_refs").write_text("5")  # the peak resident set starts here
    baseline = _status_kib("VmRSS") * 1024
    store = (DiskWeightStore(cache / mode, {"layers": layers, "hidden": hidden}, pin=False) if mode == "disk"
             else HostWeightStore(pin=False))
    t0 = time.perf_counter()
    model = random_layerwise_qlora(config, device=torch.device("cpu"), dtype=torch.bfloat16, attention="sdpa",
                                   store=store)
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))
    model.train()
    streamer = FrozenWeightStreamer(model, store)
    layer_bytes = sum(streamer.layer_bytes)
    if mode == "resident":
        streamer.remove()  # every layer back in place, and the store's copies dropped
    build_s = time.perf_counter() - t0
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    step_s = time.perf_counter() - t0
    return {"mode": mode, "peak_rss_bytes": _status_kib("VmHWM") * 1024, "baseline_rss_bytes": baseline,
            "layer_bytes": layer_bytes, "loss": loss.item(), "build_s": build_s, "step_s": step_s,
            "most_resident_layers": streamer.stats["most_resident_layers"]}


def measure(layers: int, hidden: int, intermediate: int, seq: int, modes=MODES, vocab: int = 8192,
            rank: int = 8) -> list[dict]:
    """One child per mode; their results, in `modes`' order."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="maximus-rss-") as cache:
        for mode in modes:
            cmd = [sys.executable, __file__, "--child", mode, "--layers", str(layers), "--hidden", str(hidden),
                   "--intermediate", str(intermediate), "--seq", str(seq), "--vocab", str(vocab), "--rank", str(rank),
                   "--cache", cache]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, env={
                **os.environ, "TOKENIZERS_PARALLELISM": "false", "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| mode | 4-bit layers (GiB) | peak RSS (GiB) | after imports (GiB) | peak / layers | step (s) | loss |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['layer_bytes'] / GIB:.2f} | {r['peak_rss_bytes'] / GIB:.2f} | "
                     f"{r['baseline_rss_bytes'] / GIB:.2f} | {r['peak_rss_bytes'] / r['layer_bytes']:.2f} | "
                     f"{r['step_s']:.1f} | {r['loss']:.4f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=None, help="default: 2.6875 x hidden (Llama-2-7B's ratio)")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--child", choices=MODES)
    parser.add_argument("--cache", type=Path)
    args = parser.parse_args()
    intermediate = args.intermediate or int(args.hidden * 2.6875)
    if args.child:
        print(json.dumps(child(args.child, args.layers, args.hidden, intermediate, args.seq, args.cache, args.vocab,
                                args.rank)))
        return 0
    from _machine import cpuinfo

    print(f"# {cpuinfo('model name').get('model name', 'CPU')}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}; "
          f"{args.layers} layers, hidden {args.hidden}, intermediate {intermediate}, vocabulary {args.vocab}, "
          f"{args.seq} tokens")
    print(table(measure(args.layers, args.hidden, intermediate, args.seq, vocab=args.vocab, rank=args.rank)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
