"""LoRA at q4_k_m, served merged or apart, and a low-rank correction of the base's own rounding.

For a finished plain LoRA run of `benchmarks/qat.py` (SmolLM2-135M-Instruct, `--task regions`),
scores on its first ROWS held-out rows, in Transformers with the weights fake-quantized exactly as
the q4_k_m file rounds them (`maximus.qat`; llama.cpp's 8-bit activations aside):

- `float`: W + d (d = s B A, the adapter's change);
- `merged`: Q(W + d), what `--format gguf` writes;
- `apart`: Q(W) + d, what `--format gguf-lora` serves (the adapter in float);
- `apart + correction r`: Q(W) + d + C_r, with C_r the rank-r matrix closest to the base's rounding
  error W - Q(W) in the metric of the layer's inputs (the eigenvectors of their covariance over
  the first 64 training rows, as EoRA does), and `float + correction r`: W + d + C_r.

`--write-adapter DIR` instead writes C_16 as a PEFT adapter of the run's shape (r, alpha, target
modules; its inputs' covariance from the base alone), to start a run from it with `init_adapter`
(`benchmarks/qat.py --init-adapter DIR`).

    nice python benchmarks/qat_correction.py runs/bq-l2x-plain0/lora2x-off --rows 200
    nice python benchmarks/qat_correction.py runs/bq-l2x-plain0/lora2x-off --write-adapter runs/correction16
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

TARGET = "q4_k_m"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a finished plain LoRA run")
    parser.add_argument("--rows", type=int, default=200, help="held-out rows scored")
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--calibration-rows", type=int, nargs="+", default=None, help="training rows whose inputs "
                        "set the metric (default: the product's CALIBRATION_ROWS); several compare them")
    parser.add_argument("--write-adapter", type=Path, help="only write the rank-r correction as a PEFT adapter")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from _machine import cpu_report
    from qat import float_rows

    from maximus.data import build_run_datasets
    from maximus.export import load_tuned, run_config
    from maximus.qat.correction import CALIBRATION_ROWS, correction_factors, input_covariances
    from maximus.qat.install import _gguf_plan, _quantized_modules, gguf_rounding

    print(cpu_report(), flush=True)
    torch.set_num_threads(1)
    cfg = run_config(args.run)
    model, tokenizer = load_tuned(args.run, dtype=torch.float32)
    model.eval()
    data = build_run_datasets(cfg, tokenizer, objective="sft")
    lm = model.get_base_model()
    modules = _quantized_modules(lm)
    plan = _gguf_plan(lm, TARGET, modules)
    adapted = {p: (holder, owner) for p, holder, owner in modules if owner is not None}
    # the inputs of the base alone for a starting adapter, of the tuned model for the scores
    counts = args.calibration_rows or [CALIBRATION_ROWS]
    covs = {}
    for count in counts:
        with model.disable_adapter() if args.write_adapter else torch.no_grad():
            covs[count] = input_covariances(model, {p: h for p, (h, _) in adapted.items()}, data.train[:count],
                                            torch.device("cpu"))
    cov = covs[counts[0]]
    base = {p: h.weight.detach().clone() for p, (h, _) in adapted.items()}
    delta = {p: o.get_delta_weight("default").detach().clone() for p, (_, o) in adapted.items()}
    rounded = {p: gguf_rounding(plan[p], fp16_first=True)(base[p]) for p in adapted}
    if args.write_adapter:
        from safetensors.torch import save_file

        config = json.loads((args.run / "adapter" / "adapter_config.json").read_text())
        rank, scale = config["r"], config["lora_alpha"] / config["r"]
        tensors = {}
        for p in adapted:
            left, right = correction_factors(base[p] - rounded[p], cov[p], rank)
            tensors[f"base_model.model.{p}.lora_A.weight"] = (right / scale ** 0.5).float().contiguous()
            tensors[f"base_model.model.{p}.lora_B.weight"] = (left / scale ** 0.5).float().contiguous()
        args.write_adapter.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(args.write_adapter / "adapter_model.safetensors"))
        (args.write_adapter / "adapter_config.json").write_text(json.dumps(config, indent=2))
        print(f"wrote {args.write_adapter}: the rank-{rank} correction of {len(adapted)} matrices", flush=True)
        return
    held = data.eval[:args.rows]

    def loss(weights) -> float:
        """The held-out loss with each adapted base weight set to weights(path) (the adapter on top)."""
        with torch.no_grad():
            for p, (holder, _) in adapted.items():
                holder.weight.copy_(weights(p))
        sums = float_rows(model, held)
        return sum(s for s, _ in sums) / sum(n for _, n in sums)

    found = {"float": loss(lambda p: base[p]),
             "merged": loss(lambda p: gguf_rounding(plan[p], fp16_first=True)(base[p] + delta[p]) - delta[p]),
             "apart": loss(lambda p: rounded[p])}
    for count, cov in covs.items():
        rows = "" if len(covs) == 1 else f", {count} rows"
        for rank in args.ranks:
            fix = {p: (lambda f: f[0] @ f[1])(correction_factors(base[p] - rounded[p], cov[p], rank)).float()
                   for p in adapted}
            found[f"apart + correction {rank}{rows}"] = loss(lambda p: rounded[p] + fix[p])
            found[f"float + correction {rank}{rows}"] = loss(lambda p: base[p] + fix[p])
    gap = found["merged"] - found["float"]
    for name, value in found.items():
        note = ""
        if name.startswith("apart"):
            note = f" ({(found['merged'] - value) / gap:.0%} of the merged file's gap recovered)"
        elif name.startswith("float +"):
            note = f" ({value / found['float'] - 1:+.1%} against float)"
        print(f"{name}: {value:.4f}{note}", flush=True)


if __name__ == "__main__":
    main()
