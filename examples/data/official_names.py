"""Write official_names_train.jsonl / official_names_eval.jsonl for examples/real_chat.yaml.

The data is ISO 3166-1 as the iso-codes project publishes it (through the `pycountry` package):
every country whose official name differs from its short name, as one chat turn

    user: What is the official name of Germany?   assistant: Federal Republic of Germany

shuffled with seed 0; 40 countries are held out for the eval file, the rest train.
Run: pip install pycountry && python examples/data/official_names.py
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pycountry

HERE = Path(__file__).parent
EVAL_COUNT = 40


def main() -> None:
    rows = [{"messages": [{"role": "user", "content": f"What is the official name of {c.name}?"},
                          {"role": "assistant", "content": c.official_name}], "alpha_3": c.alpha_3}
            for c in pycountry.countries if getattr(c, "official_name", None) and c.official_name != c.name]
    random.Random(0).shuffle(rows)
    for name, part in (("official_names_eval.jsonl", rows[:EVAL_COUNT]), ("official_names_train.jsonl", rows[EVAL_COUNT:])):
        (HERE / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in part), encoding="utf-8")
        print(f"wrote {HERE / name} ({len(part)} rows)")


if __name__ == "__main__":
    main()
