"""Generate the preference pairs of examples/dpo.yaml: examples/data/dpo_pairs.jsonl.

The task matches `builtin:tiny-llama`'s tokenizer (the reverse-words vocabulary): the prompt asks
to reverse 3-5 words. Both answers hold the same words; what differs is behaviour, the kind of
thing DPO is for (tone and format rather than knowledge): the chosen answer is the calm
lower-case reversal, the rejected one shouts it (upper case, "!!!"), for half of the pairs in the
right order and for the other half in the prompt's order. Deterministic.

    python benchmarks/make_dpo_pairs.py [--n 1200] [--seed 7] [--out examples/data/dpo_pairs.jsonl]
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from maximus.builtin import WORDS


def reverse_words_pairs(n: int, seed: int = 7) -> list[dict]:
    """`n` records {prompt, chosen, rejected} (strings)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = rng.sample(WORDS, rng.randint(3, 5))
        chosen = list(reversed(words))
        rejected = [w.upper() for w in (chosen if i % 2 == 0 else words)]
        out.append({"prompt": f"Reverse: {' '.join(words)}\nAnswer:", "chosen": " " + " ".join(chosen),
                    "rejected": " " + " ".join(rejected) + "!!!"})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1200, help="number of pairs")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "examples" / "data" / "dpo_pairs.jsonl"))
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for record in reverse_words_pairs(args.n, args.seed):
            f.write(json.dumps(record) + "\n")
    print(f"wrote {args.n} pairs to {out}")


if __name__ == "__main__":
    main()
