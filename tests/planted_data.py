"""A corrupted copy of a real dataset with problems planted at known rows, for the data check's
recall and false positives (tests/data/test_data_check.py, benchmarks/data_check.py).

    planted = plant_chat(rows, tmp_path, seed=0)        # rows: [[{role, content}, ...], ...]
    planted.score(report_dict)                            # {check: (recall, false positive share)}

What is planted (each class in `per_class` rows, at random places in the file):
- exact_duplicates: a later copy of a training row (case and spacing changed);
- near_duplicates: a later copy with small edits (one word dropped, changed or mistyped per 25
  words, at least one), of rows of 15 words or more;
- leakage: an eval row that copies a training row (half exactly, half with small edits as above);
- truncated: a row whose user turn is longer than seq_len tokens;
- untrainable: an empty answer;
- repeated_answer: one answer given to six different prompts (the five after the first count);
- broken_text: mojibake (UTF-8 read as cp1252), a U+FFFD, or a control character in the answer;
- chat_structure: an assistant turn first, two user turns and no answer, or two user turns in a row;
and for preference pairs (`plant_pairs`): pair_identical, pair_empty (an empty side), and
length_bias (sides swapped in a set whose chosen answer is the shorter one: the swapped pairs
are the ones whose chosen answer is longer).

Every row not planted is clean; a check that flags one is a false positive.
"""
from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

CHAT_CLASSES = ("exact_duplicates", "near_duplicates", "leakage", "truncated", "untrainable", "repeated_answer",
                "broken_text", "chat_structure")
PAIR_CLASSES = ("pair_identical", "pair_empty", "length_bias")
_WORDS = re.compile(r"\w+")
_SUBSTITUTES = ("really", "maybe", "house", "green", "quite", "today")


@dataclass
class PlantedSet:
    """Files written, where each planted problem is, and the clean rows."""

    train: Path
    eval: Path | None
    truth: dict[str, set] = field(default_factory=dict)  # class -> {(file, line)}
    clean: set = field(default_factory=set)  # {(file, line)} of rows with nothing planted

    def score(self, report: dict) -> dict[str, tuple[float, float]]:
        """{check: (recall on its planted rows, share of clean rows it flags)}, from a report's JSON."""
        out = {}
        flagged_by = {c["name"]: {(r["file"], r["line"]) for r in c["rows"]} for c in report["checks"]}
        for name, rows in self.truth.items():
            flagged = flagged_by.get(name, set())
            out[name] = (len(flagged & rows) / len(rows) if rows else 1.0, len(flagged & self.clean) / len(self.clean))
        return out

    def false_positive_share(self, report: dict) -> float:
        """Share of clean rows flagged by any check."""
        flagged = {(r["file"], r["line"]) for c in report["checks"] for r in c["rows"]}
        return len(flagged & self.clean) / len(self.clean)


def clean_rows(rows: list[list[dict]], min_words: int = 4) -> list[list[dict]]:
    """Rows usable as clean: distinct (case and spacing aside), every turn non-empty, plain text."""
    seen, out = set(), []
    for messages in rows:
        text = " ".join(m["content"] for m in messages)
        key = " ".join(text.casefold().split())
        if key in seen or len(_WORDS.findall(text)) < min_words or any(not m["content"].strip() for m in messages):
            continue
        if any(ord(ch) < 32 and ch not in "\n\t" or ord(ch) > 126 for ch in text):
            continue  # keep non-ASCII out of the clean rows: planted mojibake is the only broken text
        seen.add(key)
        out.append(messages)
    return out


def plant_chat(rows: list[list[dict]], out_dir: Path, *, seed: int = 0, per_class: int = 20, eval_clean: int = 40,
               long_words: int = 3000) -> PlantedSet:
    """train.jsonl and eval.jsonl in `out_dir` from clean 2-turn `rows` (user, assistant), with
    `per_class` rows of each class planted; `long_words`: words of a truncated row's user turn."""
    rng = random.Random(seed)
    rows = [list(map(dict, r)) for r in clean_rows(rows)]
    rng.shuffle(rows)
    eval_rows, base = rows[:eval_clean], rows[eval_clean:]
    # Entries: (messages, class or None). Planted copies go after their source row.
    train: list[tuple[list[dict], str | None]] = [(r, None) for r in base]
    long_sources = [i for i, (r, _) in enumerate(train) if len(_WORDS.findall(_text(r))) >= 15]
    used: set[int] = set()

    def pick(pool) -> int:
        while True:
            i = rng.choice(pool)
            if i not in used:
                used.add(i)
                return i

    inserts: list[tuple[int, list[dict], str]] = []  # (after index, messages, class)
    for _ in range(per_class):
        i = pick(range(len(train)))
        inserts.append((i, [{"role": m["role"], "content": _respace(m["content"], rng)} for m in train[i][0]],
                        "exact_duplicates"))
        i = pick(long_sources)
        inserts.append((i, _edited(train[i][0], rng), "near_duplicates"))
    for k in range(per_class):
        exact = k % 2 == 0
        source = train[pick(range(len(train)) if exact else long_sources)][0]
        eval_rows.append(source if exact else _edited(source, rng))
    eval_planted = set(range(eval_clean, len(eval_rows)))

    in_place = {}
    filler = " ".join(m["content"] for r in base[:400] for m in r).split()
    for _ in range(per_class):
        i = pick(range(len(train)))
        start = rng.randrange(max(1, len(filler) - long_words))
        user = " ".join(filler[start:start + long_words])
        in_place[i] = ([{"role": "user", "content": user}, train[i][0][1]], "truncated")
        i = pick(range(len(train)))
        in_place[i] = ([train[i][0][0], {"role": "assistant", "content": ""}], "untrainable")
        i = pick(range(len(train)))
        in_place[i] = (_broken(train[i][0], rng), "broken_text")
        i = pick(range(len(train)))
        in_place[i] = (_misordered(train[i][0], rng), "chat_structure")
    for _ in range(max(1, per_class // 3)):
        answer = f"I am sorry, I cannot talk about that {rng.randrange(10**6)} right now."
        for _ in range(6):
            i = pick(range(len(train)))
            in_place[i] = ([train[i][0][0], {"role": "assistant", "content": answer}], "repeated_answer")
    for i, entry in in_place.items():
        train[i] = entry

    ordered: list[tuple[list[dict], str | None]] = []
    after: dict[int, list] = {}
    for i, messages, cls in inserts:
        after.setdefault(i, []).append((messages, cls))
    for i, entry in enumerate(train):
        ordered.append(entry)
        ordered.extend(after.get(i, []))

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train_path, eval_path = out_dir / "train.jsonl", out_dir / "eval.jsonl"
    train_path.write_text("".join(json.dumps({"messages": m}) + "\n" for m, _ in ordered), encoding="utf-8")
    eval_path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in eval_rows), encoding="utf-8")
    planted = PlantedSet(train_path, eval_path, {c: set() for c in CHAT_CLASSES})
    repeated_seen: set[str] = set()
    for line, (messages, cls) in enumerate(ordered, start=1):
        where = (str(train_path), line)
        if cls is None:
            planted.clean.add(where)
        elif cls == "repeated_answer":
            if messages[1]["content"] in repeated_seen:  # the first of a group is not a repeat
                planted.truth[cls].add(where)
            repeated_seen.add(messages[1]["content"])
        else:
            planted.truth[cls].add(where)
    for k in range(len(eval_rows)):
        (planted.truth["leakage"] if k in eval_planted else planted.clean).add((str(eval_path), k + 1))
    return planted


def plant_pairs(pairs: list[dict], out_dir: Path, *, seed: int = 0, per_class: int = 20) -> PlantedSet:
    """train.jsonl of preference `pairs` ({prompt, chosen, rejected}, chosen the shorter) with
    identical, empty and swapped pairs planted in place."""
    rng = random.Random(seed)
    pairs = [dict(p) for p in pairs]
    classes: dict[int, str] = {}
    order = list(range(len(pairs)))
    rng.shuffle(order)
    for k, i in enumerate(order[:3 * per_class]):
        cls = PAIR_CLASSES[k % 3]
        p = pairs[i]
        if cls == "pair_identical":
            p["rejected"] = p["chosen"]
        elif cls == "pair_empty":
            p[rng.choice(("chosen", "rejected"))] = ""
        else:
            p["chosen"], p["rejected"] = p["rejected"], p["chosen"]
        classes[i] = cls
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs), encoding="utf-8")
    planted = PlantedSet(path, None, {c: set() for c in PAIR_CLASSES})
    for i in range(len(pairs)):
        where = (str(path), i + 1)
        (planted.truth[classes[i]] if i in classes else planted.clean).add(where)
    return planted


def _text(messages: list[dict]) -> str:
    return " ".join(m["content"] for m in messages)


def _respace(text: str, rng: random.Random) -> str:
    """The same text after normalisation: case changed, spaces doubled."""
    text = text.upper() if rng.random() < 0.5 else text.lower()
    return text.replace(" ", "  ", 1) + (" " if rng.random() < 0.5 else "")


def _edited(messages: list[dict], rng: random.Random) -> list[dict]:
    """One small edit per 25 words (at least one): a word dropped, replaced or mistyped."""
    out = [dict(m) for m in messages]
    n_words = len(_WORDS.findall(_text(messages)))
    for _ in range(max(1, n_words // 25)):
        m = rng.choice([m for m in out if len(m["content"].split()) > 2] or out)
        words = m["content"].split()
        i = rng.randrange(len(words))
        op = rng.choice(("drop", "replace", "typo"))
        if op == "drop" and len(words) > 1:
            del words[i]
        elif op == "replace":
            words[i] = rng.choice(_SUBSTITUTES)
        elif len(words[i]) > 1:
            j = rng.randrange(len(words[i]))
            words[i] = words[i][:j] + words[i][j + 1:]
        else:
            words[i] = rng.choice(_SUBSTITUTES)
        m["content"] = " ".join(words)
    return out


def _broken(messages: list[dict], rng: random.Random) -> list[dict]:
    user, answer = dict(messages[0]), dict(messages[1])
    kind = rng.choice(("mojibake", "replacement", "control"))
    if kind == "mojibake":
        answer["content"] = (answer["content"] + " It’s a café — “naïve”.").encode("utf-8").decode("cp1252", errors="ignore")
    elif kind == "replacement":
        answer["content"] = answer["content"] + " caf\ufffd"
    else:
        answer["content"] = answer["content"].replace(" ", " \x1b", 1) if " " in answer["content"] else answer["content"] + "\x00"
    return [user, answer]


def _misordered(messages: list[dict], rng: random.Random) -> list[dict]:
    user, answer = messages[0], messages[1]
    kind = rng.choice(("assistant_first", "no_answer", "two_users"))
    if kind == "assistant_first":
        return [dict(answer), dict(user)]
    if kind == "no_answer":
        return [dict(user), {"role": "user", "content": answer["content"]}]
    return [dict(user), {"role": "user", "content": "And also this."}, dict(answer)]
