"""The data check: what is wrong with a run's data, judged on the records as the pipeline read them
(same formats, template, masks, seq_len and split; `maximus.data.records`).

    report = check_data(splits, seq_len=2048, objective="sft")
    report.to_dict()["checks"]  # [{"name", "count", "share", "threshold", "over", "rows": [{"file", "line"}]}]

Checks (`CHECKS`), each a count, its share of the rows it is about, and every flagged row:

| name               | flags                                                            | share of           |
|--------------------|------------------------------------------------------------------|--------------------|
| `exact_duplicates` | a training record equal to an earlier one after normalisation    | training records   |
| `near_duplicates`  | one with word-bigram Jaccard >= 0.7 to an earlier one (MinHash)  | training records   |
| `leakage`          | an eval row that is an exact or near copy of a training row      | eval rows          |
| `truncated`        | a record longer than seq_len that loses tokens to the cut        | records            |
| `untrainable`      | a record with no trained token (empty answer, all masked, cut away) | records         |
| `repeated_answer`  | an answer (4+ words) given to 5+ different prompts, after its first | training records |
| `broken_text`      | mojibake (ftfy), U+FFFD, or control characters                   | records            |
| `chat_structure`   | no assistant turn, roles out of order, a turn the template drops or refuses | chat records |
| `pair_identical`   | a preference pair whose chosen and rejected are equal            | pairs              |
| `pair_empty`       | a pair with an empty side                                        | pairs              |
| `length_bias`      | a pair whose chosen answer is longer than the rejected           | pairs              |

Duplicates list every copy after the first (file order); leakage lists the eval row. A check is
`over` its threshold (`THRESHOLDS`) when its share is above it (`length_bias`: above it or below
1 - it); `data.on_problem: error` stops a run on the first such check.
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

from maximus.errors import DataError

from maximus.data.duplicates import DuplicateIndex, Fingerprint, boilerplate, normalise
from maximus.data.records import DEDUPED, EMPTY, EVAL, SKIPPED, TRAIN, UNTRAINABLE, KNOWN_ROLES, RecordInfo

CHECKS = ("exact_duplicates", "near_duplicates", "leakage", "truncated", "untrainable", "repeated_answer",
          "broken_text", "chat_structure", "pair_identical", "pair_empty", "length_bias")

THRESHOLDS = {
    "exact_duplicates": 0.01, "near_duplicates": 0.05, "leakage": 0.0, "truncated": 0.05, "untrainable": 0.01,
    "repeated_answer": 0.05, "broken_text": 0.01, "chat_structure": 0.01, "pair_identical": 0.0, "pair_empty": 0.0,
    "length_bias": 0.8,
}
"""Share of its rows above which a check is a problem (`length_bias`: above it, or below 1 - it)."""

REPEATED_ANSWER_PROMPTS = 5  # an answer given to this many different prompts is repeated
REPEATED_ANSWER_WORDS = 4  # shorter answers ("Yes", "That's great", a label) may repeat by design
EXAMPLE_ROWS = 5  # rows printed per check in the summary (the JSON has all of them)

_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
HELD_OUT = (EVAL,)
USED = (TRAIN, EVAL, DEDUPED, UNTRAINABLE)  # records whose document was built


@dataclass
class CheckResult:
    """One check: how many rows it flags among `total`, and which (file, line) they are."""

    name: str
    count: int
    total: int
    rows: list[RecordInfo]
    detail: dict = field(default_factory=dict)

    @property
    def share(self) -> float:
        return self.count / self.total if self.total else 0.0

    @property
    def threshold(self) -> float:
        return THRESHOLDS[self.name]

    @property
    def over(self) -> bool:
        if not self.total:
            return False
        if self.name == "length_bias":
            return self.share > self.threshold or self.share < 1 - self.threshold
        return self.share > self.threshold

    def to_dict(self) -> dict:
        return {"name": self.name, "count": self.count, "share": round(self.share, 6), "total": self.total,
                "threshold": self.threshold, "over": self.over,
                "rows": [{"file": r.file, "line": r.line} for r in self.rows], **self.detail}


@dataclass
class DataReport:
    """Every check's result, the token lengths against seq_len, and the template preview."""

    checks: list[CheckResult]
    seq_len: int
    objective: str
    records: int  # training records interpreted
    eval_rows: int
    lengths: list[int]  # tokens of each training document (longer side of a pair)
    dedupe: str = "off"
    on_problem: str = "warn"  # data.on_problem: "error" makes `raise_problems` raise
    preview: list[dict] = field(default_factory=list)  # [{"where", "segments": [{"text", "trained"}]}]

    def check(self, name: str) -> CheckResult:
        return next(c for c in self.checks if c.name == name)

    @property
    def problems(self) -> list[CheckResult]:
        return [c for c in self.checks if c.over]

    def to_dict(self) -> dict:
        stop = self.stop_error()
        return {"objective": self.objective, "seq_len": self.seq_len, "records": self.records,
                "eval_rows": self.eval_rows, "dedupe": self.dedupe, "on_problem": self.on_problem,
                "stops": stop.one_line() if stop else None, "problems": [c.name for c in self.problems],
                "lengths": length_summary(self.lengths, self.seq_len),
                "checks": [c.to_dict() for c in self.checks], "preview": self.preview}

    def summary(self) -> dict:
        """run.json's `data_check`: the counts and shares, without the rows."""
        return {"records": self.records, "eval_rows": self.eval_rows, "problems": [c.name for c in self.problems],
                "checks": {c.name: {"count": c.count, "share": round(c.share, 6)} for c in self.checks}}

    def lines(self) -> list[str]:
        """The summary a run prints at its start and `maximus data check` prints."""
        found = [c for c in self.checks if c.count]
        head = (f"data check: {self.records} records, {self.eval_rows} eval rows, seq_len {self.seq_len}: "
                + (f"{len(self.problems)} over threshold ({', '.join(c.name for c in self.problems)})" if self.problems
                   else "nothing over threshold" if found else "clean"))
        lines = [head]
        for c in found:
            examples = ", ".join(r.where for r in c.rows[:EXAMPLE_ROWS])
            flag = "over" if c.over else "under"
            lines.append(f"  {c.name}: {c.count} ({c.share:.1%}; {flag} {c.threshold:.0%}) e.g. {examples}")
        return lines

    def raise_problems(self) -> None:
        """Raise `stop_error()` when there is one."""
        error = self.stop_error()
        if error is not None:
            raise error

    def stop_error(self) -> DataError | None:
        """Under `data.on_problem: error`, the one-line error naming the first check over its threshold."""
        if self.on_problem != "error" or not self.problems:
            return None
        c = self.problems[0]
        first = c.rows[0].where if c.rows else "-"
        return DataError(f"data check: {c.name} in {c.share:.1%} of {_unit(c.name)} ({c.count} of {c.total}), over its "
                        f"threshold {c.threshold:.0%}; first row {first}",
                        "fix the data (maximus data check --config ... --json lists every row), set data.dedupe / "
                        "data.drop_untrainable, or data.on_problem: warn")


def check_data(splits, *, seq_len: int, objective: str = "sft", dedupe: str = "off", on_problem: str = "warn",
               tokenizer=None) -> DataReport:
    """Run every check on `splits.records` (a `maximus.data.DataSplits`). `tokenizer`: to render
    the template preview from `splits.preview`."""
    n_sources = len(splits.stats.get("sources", []))
    records = splits.records
    training = sorted((r for r in records if r.source < n_sources and r.split != SKIPPED),
                      key=lambda r: (r.source, r.position))
    held_out = [r for r in records if r.split in HELD_OUT]
    used = [r for r in records if r.split != SKIPPED]
    pairs = [r for r in used if r.rejected is not None]
    fingerprints = {id(r): Fingerprint.of(r.content) for r in (*training, *held_out)}
    common = boilerplate(fingerprints[id(r)] for r in training)
    exact, near = _duplicates(training, fingerprints, common)
    checks = [
        CheckResult("exact_duplicates", len(exact), len(training), exact),
        CheckResult("near_duplicates", len(near), len(training), near),
        _leakage(training, held_out, fingerprints, common),
        _truncated(used),
        _untrainable(used, objective),
        _repeated_answers(training),
        _broken_text(used),
        _chat_structure(records, objective),
        _flag("pair_identical", pairs, lambda r: bool(r.answer.strip()) and normalise(r.answer) == normalise(r.rejected)),
        _flag("pair_empty", pairs, lambda r: not r.answer.strip() or not r.rejected.strip()),
        _flag("length_bias", [r for r in pairs if r.answer.strip() and r.rejected.strip() and r.answer != r.rejected],
              lambda r: len(r.answer) > len(r.rejected)),
    ]
    lengths = [r.tokens for r in training if r.split in (TRAIN, UNTRAINABLE)]
    preview = [render_preview(tokenizer, d) for d in splits.preview] if tokenizer is not None else []
    return DataReport(checks, seq_len, objective, len(training), len(held_out), lengths, dedupe, on_problem, preview)


def length_summary(lengths: list[int], seq_len: int) -> dict:
    """Token lengths of the training documents: quantiles and how many pass seq_len."""
    if not lengths:
        return {"documents": 0}
    ordered = sorted(lengths)

    def q(p: float) -> int:
        return ordered[min(len(ordered) - 1, int(p * len(ordered)))]

    return {"documents": len(ordered), "min": ordered[0], "p50": q(0.5), "p90": q(0.9), "p99": q(0.99),
            "max": ordered[-1], "over_seq_len": sum(n > seq_len for n in ordered)}


def render_preview(tokenizer, document) -> dict:
    """A document as the model sees it: its text in runs of trained / untrained tokens."""
    from maximus.data.encoding import IGNORE_INDEX

    segments: list[dict] = []
    run: list[int] = []
    trained = None
    for token, label in zip(document.input_ids, document.labels):
        flag = label != IGNORE_INDEX
        if flag != trained and run:
            segments.append({"text": tokenizer.decode(run), "trained": trained})
            run = []
        trained = flag
        run.append(token)
    if run:
        segments.append({"text": tokenizer.decode(run), "trained": trained})
    return {"where": document.where, "segments": segments}


# ------------------------------------------------------------------------------------------ checks
def _duplicates(training: list[RecordInfo], fingerprints: dict,
                common: frozenset) -> tuple[list[RecordInfo], list[RecordInfo]]:
    """(exact copies, near copies) of earlier training records, in file order."""
    index = DuplicateIndex(near=True, common=common)
    exact, near = [], []
    for i, record in enumerate(training):
        found = index.add(i, fingerprints[id(record)])
        if found is not None:
            (exact if found[0] == "exact" else near).append(record)
    return exact, near


def _leakage(training: list[RecordInfo], held_out: list[RecordInfo], fingerprints: dict,
             common: frozenset) -> CheckResult:
    index = DuplicateIndex(near=True, common=common)
    for i, record in enumerate(r for r in training if r.split == TRAIN):
        index.add(i, fingerprints[id(record)])
    exact = near = 0
    leaked = []
    for record in held_out:
        found = index.match(fingerprints[id(record)])
        if found is not None:
            leaked.append(record)
            exact += found[0] == "exact"
            near += found[0] == "near"
    return CheckResult("leakage", len(leaked), len(held_out), leaked, {"exact": exact, "near": near})


def _truncated(used: list[RecordInfo]) -> CheckResult:
    cut = [r for r in used if r.lost_tokens > 0]
    return CheckResult("truncated", len(cut), len(used), cut,
                       {"tokens_lost": sum(r.lost_tokens for r in cut),
                        "trained_part_cut_away": sum(r.loss_tokens > 0 and r.kept_loss_tokens == 0 for r in cut)})


def _untrainable(used: list[RecordInfo], objective: str) -> CheckResult:
    labelled = objective in ("sft", "dpo")

    def nothing_trained(r: RecordInfo) -> bool:  # an empty answer trains only the end-of-turn token: nothing
        return (r.split in (EMPTY, UNTRAINABLE) or (labelled and r.kept_loss_tokens == 0)
                or (r.answer is not None and not r.answer.strip()))

    flagged = [r for r in used if nothing_trained(r)]
    return CheckResult("untrainable", len(flagged), len(used), flagged,
                       {"no_trained_tokens": sum(r.split == EMPTY for r in flagged),
                        "empty_answer": sum(r.split != EMPTY and r.answer is not None and not r.answer.strip()
                                            for r in flagged),
                        "trained_part_cut_away": sum(r.split != EMPTY and r.loss_tokens > 0 and r.kept_loss_tokens == 0
                                                     for r in flagged)})


def _repeated_answers(training: list[RecordInfo]) -> CheckResult:
    groups: dict[str, list[RecordInfo]] = defaultdict(list)
    for record in training:
        if record.answer and record.prompt and len(record.answer.split()) >= REPEATED_ANSWER_WORDS:
            groups[normalise(record.answer)].append(record)
    flagged = []
    for group in groups.values():
        if len(group) >= REPEATED_ANSWER_PROMPTS and len({normalise(r.prompt) for r in group}) >= REPEATED_ANSWER_PROMPTS:
            flagged.extend(group[1:])
    flagged.sort(key=lambda r: (r.source, r.position))
    answered = sum(bool(r.answer) and bool(r.prompt) for r in training)  # None or "": no answer to repeat
    return CheckResult("repeated_answer", len(flagged), answered, flagged)


def broken_text_kind(text: str) -> str | None:
    """"replacement", "control" or "mojibake" (ftfy's detector) for a text that has it, else None."""
    if "\ufffd" in text:
        return "replacement"
    if _CONTROL.search(text):
        return "control"
    if text.isascii():  # mojibake is non-ASCII by nature: skip ftfy's detector
        return None
    from ftfy.badness import is_bad

    return "mojibake" if is_bad(text) else None


def _broken_text(used: list[RecordInfo]) -> CheckResult:
    kinds: dict[str, int] = defaultdict(int)
    flagged = []
    for record in used:
        kind = next((k for k in map(broken_text_kind, record.texts) if k), None)
        if kind:
            kinds[kind] += 1
            flagged.append(record)
    return CheckResult("broken_text", len(flagged), len(used), flagged, {"kinds": dict(kinds)})


def chat_problem(roles: tuple[str, ...], needs_answer: bool = True) -> str | None:
    """What is wrong with the order of a conversation's roles, or None."""
    for i, role in enumerate(roles):
        if role not in KNOWN_ROLES:
            return f"unknown role '{role}'"
        if role == "system" and i > 0:
            return f"system turn at position {i + 1}"
    turns = [r for r in roles if r != "system"]
    if turns and turns[0] == "assistant":
        return "starts with an assistant turn"
    for a, b in zip(turns, turns[1:]):
        if a == b and a in ("user", "assistant"):
            return f"two {a} turns in a row"
    if needs_answer and "assistant" not in roles:
        return "no assistant turn"
    return None


def _chat_structure(records: list[RecordInfo], objective: str) -> CheckResult:
    chats = [r for r in records if r.roles is not None or (r.split == SKIPPED and "cannot tokenize" in (r.problem or ""))]
    kinds: dict[str, int] = defaultdict(int)
    flagged = []
    for record in chats:
        if record.split == SKIPPED:
            problem = "refused by the template"
        elif record.dropped_turns:
            problem = "a turn the template drops"
        else:
            problem = chat_problem(record.roles, needs_answer=objective != "grpo")
        if problem:
            kinds[problem] += 1
            flagged.append(record)
    return CheckResult("chat_structure", len(flagged), len(chats), flagged, {"kinds": dict(kinds)})


def _flag(name: str, rows: list[RecordInfo], test) -> CheckResult:
    flagged = [r for r in rows if test(r)]
    return CheckResult(name, len(flagged), len(rows), flagged)


def _unit(name: str) -> str:
    return {"exact_duplicates": "training records", "near_duplicates": "training records", "leakage": "eval rows",
            "repeated_answer": "answered training records", "chat_structure": "conversations",
            "pair_identical": "pairs", "pair_empty": "pairs", "length_bias": "pairs"}.get(name, "records")


def check_run(cfg, splits, tokenizer=None) -> DataReport:
    """`check_data` with a run's settings (`maximus.config.Config`)."""
    return check_data(splits, seq_len=cfg.training.seq_len, objective=cfg.objective, dedupe=cfg.data.dedupe,
                      on_problem=cfg.data.on_problem, tokenizer=tokenizer)


def preview_text(preview: dict, colour: bool) -> str:
    """A preview document as text: trained runs in green on a terminal (`colour`), else between ⟦ ⟧."""
    parts = []
    for segment in preview["segments"]:
        text = segment["text"]
        if segment["trained"]:
            text = f"\x1b[1;32m{text}\x1b[0m" if colour else f"⟦{text}⟧"
        parts.append(text)
    return "".join(parts)
