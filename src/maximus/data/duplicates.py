"""Exact and near-duplicate texts, in order: each text is compared with the earlier ones.

- exact: equal after `normalise` (Unicode NFKC, case folded, runs of whitespace as one space,
  ends stripped), compared by a 128-bit BLAKE2b digest of the normalised text;
- near: word-bigram Jaccard similarity >= `NEAR_THRESHOLD` (words are runs of letters and
  digits, case folded, so punctuation and spacing edits do not count), on the bigrams that are
  not boilerplate: a bigram found in more than `BOILERPLATE_SHARE` of the texts (and in at least
  `BOILERPLATE_MIN_TEXTS`) is a template's ("what is the official name of ..."), and would make
  every short templated record look like every other. Candidates come from
  MinHash LSH (the `rensa` library: `NUM_PERM` permutations in `NUM_BANDS` bands, which finds
  pairs from about 0.5 similarity on), and each candidate is confirmed on the exact Jaccard
  similarity of the two bigram sets, so a MinHash estimate never flags a pair by itself.

A text is matched only against earlier texts that are not duplicates themselves (the first of
each group), so dropping every flagged text keeps exactly one of each group and no two kept
texts are near each other by a chain.
"""
from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

from rensa import RMinHash, RMinHashLSH

NEAR_THRESHOLD = 0.7
"""Word-bigram Jaccard similarity from which two texts are near-duplicates."""

BOILERPLATE_SHARE = 0.1
BOILERPLATE_MIN_TEXTS = 20

NUM_PERM = 128
NUM_BANDS = 32  # 4 rows a band: candidates from about (1/32) ** (1/4) = 0.42 similarity
MINHASH_SEED = 0

_WORD = re.compile(r"\w+")
_SPACE = re.compile(r"\s+")


def normalise(text: str) -> str:
    """The text exact duplicates are compared on."""
    return _SPACE.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def digest(text: str) -> bytes:
    """16-byte BLAKE2b of the normalised text (the exact-duplicate key)."""
    return hashlib.blake2b(normalise(text).encode("utf-8"), digest_size=16).digest()


def bigrams(text: str) -> frozenset[str]:
    """The word bigrams of a text (its single word, for a one-word text)."""
    return _bigrams_of_normalised(normalise(text))


def _bigrams_of_normalised(text: str) -> frozenset[str]:
    words = _WORD.findall(text)
    return frozenset(f"{a} {b}" for a, b in zip(words, words[1:])) if len(words) > 1 else frozenset(words)


@dataclass
class Fingerprint:
    """What a text is compared on, computed once: its digest and its word bigrams."""

    digest: bytes
    bigrams: frozenset[str]

    @classmethod
    def of(cls, text: str) -> "Fingerprint":
        normal = normalise(text)
        return cls(hashlib.blake2b(normal.encode("utf-8"), digest_size=16).digest(), _bigrams_of_normalised(normal))


def boilerplate(fingerprints) -> frozenset[str]:
    """The bigrams in more than BOILERPLATE_SHARE of the texts (and at least BOILERPLATE_MIN_TEXTS)."""
    from collections import Counter

    counts: Counter = Counter()
    n = 0
    for fingerprint in fingerprints:
        counts.update(fingerprint.bigrams)
        n += 1
    floor = max(BOILERPLATE_MIN_TEXTS, BOILERPLATE_SHARE * n)
    return frozenset(b for b, c in counts.items() if c > floor)


def jaccard(a: frozenset, b: frozenset) -> float:
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)


class DuplicateIndex:
    """Texts (as `Fingerprint`s) added in order; `add` says which earlier kept text a new one copies.

    With `near=False` only exact duplicates are looked for (no MinHash work at all). `common`:
    the boilerplate bigrams left out of the comparison (`boilerplate(fingerprints)`)."""

    def __init__(self, near: bool = True, threshold: float = NEAR_THRESHOLD, common: frozenset = frozenset()):
        self.near = near
        self.threshold = threshold
        self.common = common
        self._first: dict[bytes, int] = {}  # digest -> key of the first text with it
        self._shingles: dict[int, frozenset] = {}
        self._lsh = None
        if near:
            self._lsh = RMinHashLSH(threshold=threshold, num_perm=NUM_PERM, num_bands=NUM_BANDS)

    def match(self, fingerprint: Fingerprint) -> tuple[str, int] | None:
        """("exact" | "near", key of the earlier text) for a duplicate, else None; adds nothing."""
        return self._match(fingerprint)[0]

    def add(self, key: int, fingerprint: Fingerprint) -> tuple[str, int] | None:
        """Match `fingerprint` against the kept texts, and keep it when it is no duplicate."""
        found, shingles, minhash = self._match(fingerprint)
        if found is None:
            self._first[fingerprint.digest] = key
            if self.near:
                self._shingles[key] = shingles
                if minhash is not None:
                    self._lsh.insert(key, minhash)
        return found

    def _match(self, fingerprint: Fingerprint):
        """(what `match` returns, the bigrams compared, their MinHash or None)."""
        found = self._first.get(fingerprint.digest)
        if found is not None:
            return ("exact", found), None, None
        if not self.near:
            return None, None, None
        shingles = self.shingles(fingerprint)
        if not shingles:
            return None, shingles, None
        minhash = _minhash(shingles)
        for key in sorted(self._lsh.query(minhash)):
            if jaccard(shingles, self._shingles[key]) >= self.threshold:
                return ("near", key), shingles, minhash
        return None, shingles, minhash

    def shingles(self, fingerprint: Fingerprint) -> frozenset[str]:
        """The bigrams compared: a text's own, boilerplate left out (all of them when that is all it has)."""
        return (fingerprint.bigrams - self.common) or fingerprint.bigrams


def find_duplicates(texts: Sequence[str], near: bool = True) -> list[tuple[str, int] | None]:
    """For each text, in order: ("exact" | "near", index of the first copy) or None."""
    fingerprints = [Fingerprint.of(text) for text in texts]
    index = DuplicateIndex(near=near, common=boilerplate(fingerprints) if near else frozenset())
    return [index.add(i, f) for i, f in enumerate(fingerprints)]


def _minhash(shingles: frozenset):
    m = RMinHash(num_perm=NUM_PERM, seed=MINHASH_SEED)
    m.update(list(shingles))  # MinHash is order-free
    return m
