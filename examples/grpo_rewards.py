"""Reward functions for examples/grpo.yaml (TRL's convention: (prompts, completions, **columns) -> floats).

The task: reverse a list of words. `answer` (a dataset column) is the reversed list.
"""


def reversed_words(prompts, completions, answer, **kwargs):
    """Partial credit: the share of positions holding the right word, over the longer of the two
    lists (so extra or missing words cost); 1.0 only for the exact reversed list."""
    rewards = []
    for completion, want in zip(completions, answer):
        got, want = completion.split(), want.split()
        hits = sum(g == w for g, w in zip(got, want))
        rewards.append(hits / max(len(got), len(want), 1))
    return rewards
