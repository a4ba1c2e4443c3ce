"""Generate the prompts of examples/grpo.yaml: examples/data/grpo_reverse.jsonl.

The quickstart's task (`builtin:reverse-words`: reverse 3-5 words) in a wording its SFT adapter
never saw: `Reverse red whale olive` where the quickstart trained on `Reverse: red whale olive`
(the adapter reverses about half of these exactly, against 88 % in its own wording). The records
are prompts without answers to imitate: each holds the prompt and, in a column the reward
functions read, the `answer`. GRPO learns from the reward alone (examples/grpo_rewards.py and the
built-in exact_answer). Drawn with another seed than the quickstart's training data. Deterministic.

    python benchmarks/make_grpo_prompts.py [--n 600] [--seed 2026] [--min-words 3] [--max-words 5]
        [--template 'Reverse {words}\nAnswer:'] [--out examples/data/grpo_reverse.jsonl]
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from maximus.builtin import WORDS

#: The example's prompt: the quickstart's (`builtin:reverse-words`) without the colon after "Reverse".
TEMPLATE = "Reverse {words}\nAnswer:"


def reverse_words_prompts(n: int, seed: int = 2026, min_words: int = 3, max_words: int = 5,
                          template: str = TEMPLATE) -> list[dict]:
    """`n` records {prompt, answer} (strings) of `min_words`..`max_words` words, the prompt
    `template` with `{words}` filled in."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = rng.sample(WORDS, rng.randint(min_words, max_words))
        out.append({"prompt": template.format(words=" ".join(words)), "answer": " ".join(reversed(words))})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=600)
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--min-words", type=int, default=3)
    parser.add_argument("--max-words", type=int, default=5)
    parser.add_argument("--template", default=TEMPLATE, help="the prompt, with {words}")
    parser.add_argument("--out", type=Path, default=Path("examples/data/grpo_reverse.jsonl"))
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for record in reverse_words_prompts(args.n, args.seed, args.min_words, args.max_words, args.template):
            f.write(json.dumps(record) + "\n")
    tmp.replace(args.out)
    print(f"wrote {args.n} prompts to {args.out}")


if __name__ == "__main__":
    main()
