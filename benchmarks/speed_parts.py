"""The smaller speed findings of docs/benchmarks/speed.md, each measured side by side in one run.

Modes (each alternates the two variants step by step in one process and prints medians):

* ``buffers``: a 256 x 512 @ 512 x 128,256 bf16 matmul into a fresh output vs into a reused one
  (why `ChunkScratch` exists), a chunk's softmax work in four passes vs the fused kernel, and the
  exact loss's forward + backward at several chunk sizes (vocabularies 128,256 and 32,000).
* ``norms``: the reference-model QLoRA step with PEFT's float32 frozen norms vs Maximus' bf16 ones.
* ``compile``: the same step eager vs with regional ``torch.compile`` of the decoder layers
  (prints the compile time; several minutes on 2 cores).
* ``padding``: quickstart steps, stock padded batches through Transformers' SDPA vs Maximus'
  padding-free attention, with packing on (many ~16-token documents per row) and off.
* ``faults``: the output layer of one fp32 2,048-token step, the peer's way (full logits,
  ``F.cross_entropy``, backward) vs Maximus' exact loss, alternating: wall seconds, minor page
  faults and system CPU seconds per step (`getrusage`): why the fp32 ratio to the peer depends on
  the host's page-fault cost (docs/benchmarks/speed.md).
* ``threads``: quickstart steps with torch's default thread count (every core) vs
  `maximus.kernels.cpu_threads`' choice, while ``--busy`` other processes spin on the cores.

    python benchmarks/speed_parts.py buffers
    python benchmarks/speed_parts.py norms
    python benchmarks/speed_parts.py compile
    python benchmarks/speed_parts.py padding
    python benchmarks/speed_parts.py faults
    python benchmarks/speed_parts.py threads --busy 2
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
QUICKSTART = HERE.parent / "examples" / "quickstart.yaml"


def alternate(variants: dict, steps: int) -> dict:
    """Run each variant's step function in turn `steps` times; median seconds per variant."""
    times = {name: [] for name in variants}
    for i in range(1, steps + 1):
        for name, step in variants.items():
            t = time.perf_counter()
            step(i)
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def report(title: str, medians: dict) -> None:
    base = next(iter(medians.values()))
    print(f"\n{title}\n\n| variant | median s | ratio to first |\n|---|---:|---:|")
    for name, t in medians.items():
        print(f"| {name} | {t:.4f} | {t / base:.2f}x |")


def buffers(args) -> None:
    from maximus.losses.linear_cross_entropy import linear_cross_entropy

    vocab, hidden, rows = 128256, 512, 256
    w = (torch.randn(vocab, hidden) * 0.02).to(torch.bfloat16)  # realistic logit scale: no denormal exps
    x = torch.randn(rows, hidden, dtype=torch.bfloat16)
    out = torch.empty(rows, vocab, dtype=torch.bfloat16)
    flops = 2 * rows * vocab * hidden
    medians = alternate({"fresh output": lambda i: x @ w.t(), "reused output": lambda i: torch.mm(x, w.t(), out=out)},
                        args.steps)
    report(f"matmul {rows}x{hidden} @ {hidden}x{vocab}, bf16 ({', '.join(f'{k}: {flops / v / 1e9:.0f} GFLOP/s' for k, v in medians.items())})",
           medians)
    # A chunk's softmax work: the four passes the loss used to make vs the fused in-place kernel it uses now.
    raw = (x @ w.t()).mul_(8)  # logits of a realistic spread
    stats = torch.empty(rows, vocab)
    labels = torch.randint(0, vocab, (rows, 1))

    def four_passes(i):
        s = stats.copy_(raw)
        m = s.amax(dim=1)
        p = s.sub_(m[:, None]).exp_()
        p.mul_((1.0 / p.sum(dim=1))[:, None]).scatter_add_(1, labels, torch.full((rows, 1), -1.0))
        out.copy_(p)

    def fused(i):
        s = stats.copy_(raw)
        m = s.amax(dim=1)
        p = torch.ops.aten._softmax.out(s, 1, False, out=s)
        m - p.amax(dim=1).log()
        p.scatter_add_(1, labels, torch.full((rows, 1), -1.0))
        out.copy_(p)

    report(f"softmax + gradient of one {rows} x {vocab} chunk: max / subtract / exp / sum / scale passes vs "
           "PyTorch's fused softmax in place", alternate({"four passes": four_passes, "fused": fused}, args.steps))
    for vocab_size in (vocab, 32000):
        head = w[:vocab_size]
        h = torch.randn(2048, hidden, dtype=torch.bfloat16, requires_grad=True)
        y = torch.randint(0, vocab_size, (2048,))
        chunks = {f"chunk {c}": (lambda i, c=c: linear_cross_entropy(h, head, y, chunk_size=c, reduction="sum").backward())
                  for c in (64, 87, 128, 256, 512, 1024)}
        report(f"exact loss forward + backward, 2048 tokens, frozen bf16 head {vocab_size:,} x {hidden}",
               alternate(chunks, 3))


def _reference_trainers(n: int, tmp: Path, steps: int):
    import finetune_vs_peft as fvp
    from _reference_model import REFERENCE_CONFIG, reference_model_dir

    ids = fvp.synthetic_ids(steps, 2048, REFERENCE_CONFIG["vocab_size"])
    out = []
    for k in range(n):
        (tmp / str(k)).mkdir()
        step, model, _, set_rows, _ = fvp.build_maximus(reference_model_dir(), "qlora", 2048, "off", steps,
                                                        tmp / str(k), train_mode=True, meter=False)
        set_rows(ids)
        out.append((step, model))
    return out


def norms(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        (peft_like, model), (ours, _) = _reference_trainers(2, Path(tmp), args.steps + 1)
        for name, p in model.named_parameters():  # back to what prepare_model_for_kbit_training leaves
            if not p.requires_grad and "norm" in name:
                p.data = p.data.float()
        peft_like(1), ours(1)
        report("reference-model QLoRA step, seq 2048", alternate({"fp32 frozen norms": lambda i: peft_like(i + 1),
                                                                  "bf16 frozen norms": lambda i: ours(i + 1)}, args.steps))


def compile_mode(args) -> None:
    from maximus.kernels import compile_decoder_layers

    with tempfile.TemporaryDirectory() as tmp:
        (eager, _), (compiled, model) = _reference_trainers(2, Path(tmp), args.steps + 1)
        eager(1)
        t = time.perf_counter()
        compile_decoder_layers(model)
        compiled(1)
        print(f"compile + first step: {time.perf_counter() - t:.0f} s")
        report("reference-model QLoRA step, seq 2048", alternate({"eager": lambda i: eager(i + 1),
                                                                  "regional compile": lambda i: compiled(i + 1)}, args.steps))


def _quickstart(tmp: Path, name: str, *overrides: str, padded: bool = False):
    from maximus import Config, Trainer

    cfg = Config.from_yaml(QUICKSTART, overrides=[f"output_dir={tmp / name}", "eval.enabled=false",
                                                  "logging.progress=none", *overrides])
    trainer = Trainer(cfg)
    trainer.setup()
    if padded:  # stock Transformers: SDPA with its packed mask, padded batches
        trainer.model.get_base_model().set_attn_implementation("sdpa")
        trainer.kernels.attention = "sdpa"
    return lambda i: trainer.train_step(i)


def padding(args) -> None:
    for title, extra in (("quickstart, packing on (rows of 128 tokens, ~16-token documents)", ()),
                         ("quickstart, packing off (rows up to 512 tokens)", ("training.packing=false", "training.seq_len=512"))):
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            variants = {"padded, Transformers SDPA": _quickstart(tmp, "a", *extra, padded=True),
                        "padding-free": _quickstart(tmp, "b", *extra)}
            alternate(variants, 2)
            report(title, alternate(variants, args.steps))


def threads(args) -> None:
    from maximus.kernels import cpu_threads

    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        time.sleep(1.0)
        with tempfile.TemporaryDirectory() as tmp:
            step = _quickstart(Path(tmp), "t")
            every_core = os.cpu_count() or 1
            chosen = cpu_threads(torch.device("cpu"))

            def with_threads(n):
                def run(i):
                    torch.set_num_threads(n)
                    step(i)
                return run

            report(f"quickstart step with {args.busy} busy processes on {every_core} cores",
                   alternate({f"{every_core} threads (torch default)": with_threads(every_core),
                              f"{chosen} thread(s) (cpu_threads)": with_threads(chosen)}, args.steps))
    finally:
        for p in busy:
            p.kill()


def faults(args) -> None:
    import torch.nn.functional as F

    from maximus.losses.linear_cross_entropy import linear_cross_entropy

    tokens, hidden, vocab = 2048, 512, 128256
    h = torch.randn(tokens, hidden, requires_grad=True)
    w = torch.randn(vocab, hidden) * 0.02  # a frozen fp32 head, as in a LoRA step
    y = torch.randint(0, vocab, (tokens,))

    def peer():
        F.cross_entropy(h @ w.t(), y, reduction="sum").backward()

    def ours():
        linear_cross_entropy(h, w, y, reduction="sum").backward()

    rows = {"peer: full logits + F.cross_entropy": peer, "Maximus: exact chunked loss": ours}
    seen = {name: [] for name in rows}
    for _ in range(args.steps):
        for name, step in rows.items():
            h.grad = None
            before, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            step()
            after = resource.getrusage(resource.RUSAGE_SELF)
            seen[name].append((time.perf_counter() - t, after.ru_minflt - before.ru_minflt,
                               after.ru_stime - before.ru_stime))
    print(f"\noutput layer of one fp32 step: {tokens} tokens, head {vocab:,} x {hidden}, forward + backward, "
          f"{torch.get_num_threads()} threads, {args.steps} alternating steps (medians)\n\n"
          "| variant | wall s | minor page faults | system CPU s |\n|---|---:|---:|---:|")
    for name, values in seen.items():
        wall, flt, sys_s = (statistics.median(v[k] for v in values) for k in range(3))
        print(f"| {name} | {wall:.2f} | {flt:,.0f} | {sys_s:.2f} |")
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists():
        print(f"\ntransparent huge pages: {thp.read_text().strip()}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("buffers", "norms", "compile", "padding", "faults", "threads"))
    p.add_argument("--steps", type=int, default=5, help="measured steps per variant")
    p.add_argument("--busy", type=int, default=2, help="threads mode: spinning processes")
    args = p.parse_args(argv)
    if "OMP_NUM_THREADS" not in os.environ and args.mode != "threads":
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    {"buffers": buffers, "norms": norms, "compile": compile_mode, "padding": padding, "faults": faults,
     "threads": threads}[args.mode](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
