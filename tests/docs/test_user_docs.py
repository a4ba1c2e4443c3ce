"""User docs (README.md, CONTRIBUTING.md, docs/) speak of the product: no words about how it was
made, and no reference to a file outside the repository; every relative link resolves."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").rglob("*.md")])

#: How-it-was-made words: a result needs its machine, date and command, not its history.
PROCESS_WORDS = re.compile(
    r"\bsessions?\b|\bissues? \d+|\bissue-\d+|\bthe peer\b|\bpeer's\b|\bhelpers'|\bhelper H\d+|\blent\b"
    r"|\(goal[^)]*: met\)|\bgoal met\b",
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
    ("measured in session 5 (goal 0.35x: met)", ["session", "(goal 0.35x: met)"]),
    ("before issue 23, against the peer", ["issue 23", "the peer"]),
    ("no GPU lent yet", ["lent"]),
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
