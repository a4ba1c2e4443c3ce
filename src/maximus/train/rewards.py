"""Reward functions for `objective: grpo`: loading them, the built-ins, and scoring a group.

A reward function follows TRL's convention, so existing ones work unchanged:

    def my_reward(prompts, completions, completion_ids, **columns) -> list[float | None]

called with one group (the `group_size` completions of one prompt): `prompts[i]` is the prompt
(a string, or the message list of a chat prompt), `completions[i]` the decoded completion (a
string, or `[{"role": "assistant", "content": text}]` for a chat prompt, as TRL passes them),
`completion_ids[i]` its token ids, and each other dataset column arrives as a keyword with one
value per completion (`answer=[...]`). It returns one number per completion, or None to skip one
(that function then does not count for it). Accept `**kwargs` to ignore the columns you do not use.

`grpo.rewards` names them: `package.module:function`, `path/to/file.py:function` (relative to the
working directory), or a built-in:

- `exact_answer`: 1.0 when the completion equals the `grpo.answer_field` column after
  normalisation (Unicode NFKC, case folded, whitespace collapsed, surrounding space dropped),
  else 0.0; None for a row without that column.
- `regex_format`: 1.0 when `grpo.format_pattern` matches the whole completion (`re.fullmatch`,
  DOTALL), else 0.0.

Scoring (`score_group`) combines them as TRL does: ``sum_k weight_k * reward_k`` over the
functions that scored a completion, NaN when none did. A non-finite reward (NaN, inf) is treated
as skipped and counted in `GroupScores.dropped`. Raises `RewardError` (one line, naming the
function and the prompt) when a function raises, returns the wrong number of values or a
non-number.
"""
from __future__ import annotations

import math
import re
import unicodedata
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from maximus.errors import ConfigError, RewardError
from maximus.user_code import load_function

BUILTINS = ("exact_answer", "regex_format")
SIGNATURE = "f(prompts, completions, completion_ids, **columns) -> one float or None per completion"


def completion_text(completion) -> str:
    """The text of a completion as passed to rewards: itself, or the content of a chat reply."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


def normalise_answer(text: str) -> str:
    """NFKC, case folded, whitespace runs collapsed to one space, surrounding space dropped."""
    return " ".join(unicodedata.normalize("NFKC", str(text)).casefold().split())


def exact_answer(prompts, completions, completion_ids=None, *, answer_field: str = "answer", **columns) -> list:
    """1.0 where the completion equals the row's answer after `normalise_answer`, else 0.0."""
    answers = columns.get(answer_field)
    if answers is None:
        return [None] * len(completions)
    return [None if a is None else float(normalise_answer(completion_text(c)) == normalise_answer(a))
            for c, a in zip(completions, answers)]


def regex_format(prompts, completions, completion_ids=None, *, pattern: str, **columns) -> list:
    """1.0 where `pattern` matches the whole completion (DOTALL), else 0.0."""
    compiled = re.compile(pattern, re.DOTALL)
    return [float(compiled.fullmatch(completion_text(c)) is not None) for c in completions]


@dataclass
class RewardFunction:
    """A loaded reward function and the name it is reported under (metrics `reward/<name>`)."""

    name: str
    spec: str
    fn: Callable


def load_rewards(cfg) -> list[RewardFunction]:
    """The functions of `grpo.rewards`. Raises ConfigError naming the entry that cannot load."""
    g = cfg.grpo
    if not g.rewards:
        raise ConfigError("objective grpo needs at least one reward function in grpo.rewards",
                          "e.g. grpo.rewards: [exact_answer] or [my_module:my_reward]")
    if g.reward_weights is not None and len(g.reward_weights) != len(g.rewards):
        raise ConfigError(f"grpo.reward_weights has {len(g.reward_weights)} weights for {len(g.rewards)} reward functions",
                          "give one weight per entry of grpo.rewards, or leave reward_weights out (1 each)")
    loaded, names = [], set()
    for spec in g.rewards:
        function = _load_one(spec, g)
        name = function.name
        suffix = 2
        while function.name in names:  # the same function twice (e.g. weighted differently)
            function.name = f"{name}_{suffix}"
            suffix += 1
        names.add(function.name)
        loaded.append(function)
    return loaded


def _load_one(spec: str, g) -> RewardFunction:
    if spec == "exact_answer":
        return RewardFunction(spec, spec, partial(exact_answer, answer_field=g.answer_field))
    if spec == "regex_format":
        if not g.format_pattern:
            raise ConfigError("the built-in reward regex_format needs grpo.format_pattern",
                              r"e.g. grpo.format_pattern: '<think>.*</think>\s*<answer>.*</answer>'")
        try:
            re.compile(g.format_pattern)
        except re.error as exc:
            raise ConfigError(f"grpo.format_pattern is not a valid regular expression: {exc}",
                              "check the escaping (quote it in YAML)") from None
        return RewardFunction(spec, spec, partial(regex_format, pattern=g.format_pattern))
    if ":" not in spec:
        raise ConfigError(f"grpo.rewards: {spec!r} is neither a built-in nor module:function",
                          f"use a built-in ({', '.join(BUILTINS)}), package.module:function or path/file.py:function")
    name, fn = load_function(spec, "grpo.rewards", SIGNATURE.split(' -> ')[0][2:-1], noun="reward")
    return RewardFunction(name, spec, fn)


@dataclass
class GroupScores:
    """Rewards of one group: `per_function` [G, F] (NaN = skipped or dropped), `total` [G]
    (weighted sum over the functions that scored; NaN if none did), `dropped` (non-finite values)."""

    per_function: torch.Tensor
    total: torch.Tensor
    dropped: int


def score_group(functions: list[RewardFunction], weights: list[float] | None, prompts: list, completions: list,
                completion_ids: list[list[int]], columns: dict, *, where: str) -> GroupScores:
    """Call every reward function on one group (module doc); `where` names the prompt in errors."""
    n = len(completions)
    values = torch.full((n, len(functions)), float("nan"), dtype=torch.float64)
    dropped = 0
    for k, function in enumerate(functions):
        try:
            out = function.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as exc:
            message = " ".join(str(exc).split()) or "(no message)"
            raise RewardError(f"reward function {function.spec} raised {type(exc).__name__}: {message} on {where}",
                              f"fix the function; it is called as {SIGNATURE}") from None
        if out is None or not hasattr(out, "__len__") or len(out) != n:
            got = "None" if out is None else f"{len(out)} values" if hasattr(out, "__len__") else type(out).__name__
            raise RewardError(f"reward function {function.spec} returned {got} for {n} completions on {where}",
                              "return a list with one float (or None) per completion")
        for i, value in enumerate(out):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) and not _is_scalar_tensor(value):
                raise RewardError(f"reward function {function.spec} returned {type(value).__name__} {value!r:.40} "
                                  f"for completion {i} on {where}", "return a float (or None to skip) per completion")
            value = float(value)
            if not math.isfinite(value):
                dropped += 1
                continue
            values[i, k] = value
    w = torch.tensor(weights if weights is not None else [1.0] * len(functions), dtype=torch.float64)
    total = (values * w).nansum(dim=1)
    total[torch.isnan(values).all(dim=1)] = float("nan")
    return GroupScores(values, total, dropped)


def _is_scalar_tensor(value) -> bool:
    return hasattr(value, "item") and getattr(value, "numel", lambda: 0)() == 1
