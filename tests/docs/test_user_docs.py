"""User docs (README.md, CONTRIBUTING.md, docs/) speak of the product: no words about how it was
made, and no reference to a file outside the repository; every relative link resolves."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").rglob("*.md")])

#: How-it-was-made words: a result needs its machine, date and command, not its history: no sessions,
#: issues, goals or rounds of work (an ordinal round; "2 rounds" of a benchmark's repeats is fine).
PROCESS_WORDS = re.compile(
    r"\bsessions?\b|\bissues? \d+|\bissue-\d+|\b(?:this|the) issue\b|\bthe peer\b|\bpeer's\b|\bhelpers'"
    r"|\bhelper H\d+|\blent\b|\bgoals?\b|\brounds? of work\b"
    r"|\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|latest|previous|same|this|that) round\b",
    re.IGNORECASE)
#: Files outside the repository.
OUTSIDE = re.compile(r"\bANCHORS\b|\bshared/|/work/")


def _hits(pattern: re.Pattern) -> list[str]:
    return [f"{page.relative_to(ROOT)}:{i}: {m.group(0)}" for page in PAGES
            for i, line in enumerate(page.read_text().splitlines(), 1) for m in pattern.finditer(line)]


def test_no_process_words_in_user_docs():
    assert _hits(PROCESS_WORDS) == []


def test_no_reference_outside_the_repository():
    assert _hits(OUTSIDE) == []


def test_relative_links_resolve():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            looks_like_a_path = "." in target or "/" in target  # not `f(g)` inside inline code
            if looks_like_a_path and "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []


@pytest.mark.parametrize("line, words", [
    ("measured in session 5 (goal 0.35x: met)", ["session", "goal"]),
    ("before issue 23, against the peer", ["issue 23", "the peer"]),
    ("no GPU lent yet", ["lent"]),
    ("batched / TRL: 4.14x (goal >= 2x: met in this run)", ["goal"]),
    ("Goal: peak memory <= 1.2x an SFT step. **Met: 1.00x.**", ["Goal"]),
    ("after the third round's default loss chunk, as in the fifth round", ["third round", "fifth round"]),
    ("two rounds of work later; the tests of this issue", ["rounds of work", "this issue"]),
    ("2 rounds, one round per side, round by round, clean round", []),
])
def test_the_patterns_catch_process_words(line, words):
    assert [m.group(0) for m in PROCESS_WORDS.finditer(line)] == words


def test_the_readme_is_the_door():
    """The two commands, word for word, and a config of at most 15 lines with target_vram that
    the schema accepts."""
    import yaml

    from maximus.config import Config

    readme = (ROOT / "README.md").read_text()
    assert ("pip install torch==2.13.0 && pip install -e . && maximus-train --config examples/quickstart.yaml"
            in readme)
    assert "\nbash .ci/run\n" in readme
    example = re.search(r"```yaml\n(.*?)```", readme, re.S).group(1)
    assert len(example.strip().splitlines()) <= 15
    cfg = Config.model_validate(yaml.safe_load(example))
    assert cfg.optimization.target_vram == 16e9
