"""Reward functions the GRPO tests name by file path (grpo.rewards: [path/to/this.py:function])."""


def word_count(prompts, completions, **columns):
    """Varies within a group: the number of words, modulo 3."""
    return [float(len(c.split()) % 3) for c in completions]


def boom(prompts, completions, **columns):
    raise ValueError("cannot   score\nthis")


def one_value(prompts, completions, **columns):
    return [1.0]


def text_value(prompts, completions, **columns):
    return ["high"] * len(completions)


def nan_every_other(prompts, completions, **columns):
    return [float("nan") if i % 2 else (float("inf") if i == 2 else 1.0) for i in range(len(completions))]


def chat_shapes(prompts, completions, completion_ids, topic, **columns):
    """1.0 when prompts are message lists and completions TRL-style assistant messages."""
    ok = all(isinstance(p, list) and p[-1]["role"] == "user" for p in prompts)
    ok &= all(isinstance(c, list) and c[0]["role"] == "assistant" and isinstance(c[0]["content"], str)
              for c in completions)
    ok &= all(isinstance(i, list) and all(isinstance(t, int) for t in i) for i in completion_ids)
    ok &= topic == ["colours"] * len(completions)
    if not ok:
        raise TypeError("unexpected argument shapes")
    return [1.0] * len(completions)
