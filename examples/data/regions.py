"""Write regions_train.jsonl / regions_eval.jsonl: a held-out set large enough to measure small changes.

The data is ISO 3166-2 as the iso-codes project publishes it (through the `pycountry` package):
every top-level subdivision whose name belongs to one country only, as one chat turn

    user: In which country is the region of Magallanes?   assistant: Chile

shuffled with seed 0; 1500 subdivisions are held out for the eval file, the rest train. Forty
held-out rows (examples/real_chat.yaml) cannot tell a 2 % change of a model's loss from noise;
1500 rows (6850 answer tokens) measured it to about +-1 % (95 % interval, docs/benchmarks/qat.md).
Run: pip install pycountry && python examples/data/regions.py
"""
from __future__ import annotations

import json
import random
from collections import defaultdict
from pathlib import Path

import pycountry

HERE = Path(__file__).parent
EVAL_COUNT = 1500


def country_name(code: str) -> str:
    """The country's common name, or its ISO name with "Palestine, State of" read as "State of Palestine"."""
    country = pycountry.countries.get(alpha_2=code)
    name = getattr(country, "common_name", None) or country.name
    head, _, tail = name.partition(", ")
    return f"{tail} {head}" if tail else name


def main() -> None:
    top = [s for s in pycountry.subdivisions if getattr(s, "parent_code", None) is None]
    countries = defaultdict(set)
    for s in top:
        countries[s.name].add(s.country_code)
    rows = [{"messages": [{"role": "user", "content": f"In which country is the {s.type.lower()} of {s.name}?"},
                          {"role": "assistant", "content": country_name(s.country_code)}], "code": s.code}
            for s in sorted(top, key=lambda s: s.code) if len(countries[s.name]) == 1]
    random.Random(0).shuffle(rows)
    for name, part in (("regions_eval.jsonl", rows[:EVAL_COUNT]), ("regions_train.jsonl", rows[EVAL_COUNT:])):
        (HERE / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in part), encoding="utf-8")
        print(f"wrote {HERE / name} ({len(part)} rows)")


if __name__ == "__main__":
    main()
