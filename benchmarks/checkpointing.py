"""Gradient Checkpointing 2.0 on CPU: peak memory and step time of off / full / selective / auto.

A Llama-shaped model where activations dominate (vocab 2048, hidden 512, 8 layers, intermediate
1536, 8 heads), LoRA r=16 on every linear layer, batch 1, one forward + backward per step.
Peak memory is the peak of live tensor storage bytes (parameters included) seen by a
TorchDispatchMode tracker during one step; step time is the median of `--repeats` untracked
steps, with the policies interleaved round by round so that load from other processes hits
them alike. Ratios are against `off` measured in the same run.

    python benchmarks/checkpointing.py --quick          # seq 2048, 4096; < 2 min on an idle 2-core CPU
    python benchmarks/checkpointing.py                  # seq 2048, 4096, 8192
"""
from __future__ import annotations

import argparse
import statistics
import time
import weakref

import torch
from peft import LoraConfig, get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import LlamaConfig, LlamaForCausalLM

from maximus.memory.checkpointing import apply_checkpointing, set_recompute_modes

POLICIES = ("off", "full", "selective", "auto")


class LiveStoragePeak(TorchDispatchMode):
    """Peak bytes of live tensor storages: `base` bytes held before entry plus every storage an op
    creates under the mode, counted until it is freed."""

    def __init__(self, base_bytes: int, known_storages: set[int]):
        super().__init__()
        self.current = base_bytes
        self.peak = base_bytes
        self.known = set(known_storages)

    def _free(self, key: int, nbytes: int) -> None:
        self.current -= nbytes
        self.known.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self.known:
                    self.known.add(key)
                    nbytes = storage.nbytes()
                    self.current += nbytes
                    weakref.finalize(storage, self._free, key, nbytes)
        self.peak = max(self.peak, self.current)
        return out


def build_model(seq: int, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=2048, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=max(seq, 4096),
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(dtype)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0))
    model.train()
    return model


def step(model, ids) -> float:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.item()


def peak_step(model, ids) -> tuple[int, float]:
    model.zero_grad(set_to_none=True)
    weights = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()]}
    with LiveStoragePeak(sum(weights.values()), set(weights)) as tracker:
        loss = step(model, ids)
    return tracker.peak, loss


def run_seq(seq: int, repeats: int, dtype: torch.dtype) -> list[dict]:
    model = build_model(seq, dtype)
    ids = torch.randint(0, 2048, (1, seq), generator=torch.Generator().manual_seed(1))
    rows = {}
    for policy in POLICIES:
        report = apply_checkpointing(model, policy, micro_batch=1, seq_len=seq)
        peak, loss = peak_step(model, ids)
        rows[policy] = dict(policy=policy, seq=seq, modes=report.modes, est_saved=report.total_saved_bytes,
                            est_extra=report.extra_time_fraction, peak=peak, loss=loss, times=[])
    for _ in range(repeats):
        for policy in POLICIES:
            set_recompute_modes(model, rows[policy]["modes"])
            start = time.perf_counter()
            loss = step(model, ids)
            rows[policy]["times"].append(time.perf_counter() - start)
            assert loss == rows[policy]["loss"]
    return [rows[p] for p in POLICIES]


def modes_summary(modes: list[str]) -> str:
    return " ".join(f"{modes.count(m)}x{m}" for m in ("none", "selective", "full") if modes.count(m))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="seq 2048 and 4096, one timed step each")
    parser.add_argument("--seqs", type=int, nargs="+", default=None, help="sequence lengths (tokens)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per policy (median reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    seqs = args.seqs or ([2048, 4096] if args.quick else [2048, 4096, 8192])
    repeats = args.repeats or (1 if args.quick else 3)
    dtype = getattr(torch, args.dtype)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, LoRA r=16 all-linear, batch 1")
    print()
    print("| seq | policy | layer modes | est. saved act. MiB | peak MiB | peak vs off | step s (median) | time vs off | est. extra time | loss |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for seq in seqs:
        rows = run_seq(seq, repeats, dtype)
        off = rows[0]
        off_time = statistics.median(off["times"])
        for row in rows:
            t = statistics.median(row["times"])
            same = "= off" if row["loss"] == off["loss"] else f"differs by {row['loss'] - off['loss']:.2e}"
            print(f"| {seq} | {row['policy']} | {modes_summary(row['modes'])} | {row['est_saved'] / 2**20:.0f} | "
                  f"{row['peak'] / 2**20:.0f} | {row['peak'] / off['peak']:.2f}x | {t:.2f} | {t / off_time:.2f}x | "
                  f"{row['est_extra'] * 100:.0f} % | {row['loss']:.6f} {same} |", flush=True)


if __name__ == "__main__":
    main()
