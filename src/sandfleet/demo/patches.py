"""Candidate patches for the rollout demo: edits of more-itertools' recipes.

Each candidate is what an agent might propose: some keep behaviour (a
refactor), some break a function. The demo does not trust these labels: the
reward comes from the project's own test suite run inside the sandbox; the
label is only shown beside it.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

__all__ = ["TARGET", "Candidate", "candidates", "unified_diff"]

#: The file every candidate edits, relative to the project's top directory.
TARGET = "more_itertools/recipes.py"


@dataclass(frozen=True)
class Candidate:
    """An edit replacing ``old`` (which must occur exactly once) by ``new``."""

    name: str
    old: str
    new: str
    keeps_behaviour: bool


_REFACTORS = [
    Candidate(
        "take-listcomp",
        "return list(islice(iterable, n))",
        "return [item for item in islice(iterable, n)]",
        True,
    ),
    Candidate(
        "tabulate-genexp",
        "return map(function, count(start))",
        "return (function(i) for i in count(start))",
        True,
    ),
    Candidate(
        "quantify-genexp",
        "return sum(map(pred, iterable))",
        "return sum(pred(item) for item in iterable)",
        True,
    ),
    Candidate(
        "ncycles-saved",
        "return chain.from_iterable(repeat(tuple(iterable), n))",
        "saved = tuple(iterable)\n    return chain.from_iterable(repeat(saved, n))",
        True,
    ),
    Candidate(
        "dotproduct-zip",
        "return sum(map(operator.mul, vec1, vec2))",
        "return sum(a * b for a, b in zip(vec1, vec2))",
        True,
    ),
    Candidate(
        "flatten-genexp",
        "return chain.from_iterable(listOfLists)",
        "return (item for sub in listOfLists for item in sub)",
        True,
    ),
    Candidate(
        "nth-loop",
        "return next(islice(iterable, n, None), default)",
        "for item in islice(iterable, n, None):\n        return item\n    return default",
        True,
    ),
    Candidate(
        "pad-none-comment",
        "return chain(iterable, repeat(None))",
        "# Pads forever: callers bound it (zip, islice).\n    return chain(iterable, repeat(None))",
        True,
    ),
]

_BREAKS = [
    Candidate(
        "take-off-by-one",
        "return list(islice(iterable, n))",
        "return list(islice(iterable, n + 1))",
        False,
    ),
    Candidate(
        "tabulate-skips-start",
        "return map(function, count(start))",
        "return map(function, count(start + 1))",
        False,
    ),
    Candidate(
        "quantify-plus-one",
        "return sum(map(pred, iterable))",
        "return sum(map(pred, iterable)) + 1",
        False,
    ),
    Candidate(
        "ncycles-one-short",
        "return chain.from_iterable(repeat(tuple(iterable), n))",
        "return chain.from_iterable(repeat(tuple(iterable), n - 1))",
        False,
    ),
    Candidate(
        "dotproduct-adds",
        "return sum(map(operator.mul, vec1, vec2))",
        "return sum(map(operator.add, vec1, vec2))",
        False,
    ),
    Candidate(
        "flatten-shallow",
        "return chain.from_iterable(listOfLists)",
        "return chain(listOfLists)",
        False,
    ),
    Candidate(
        "nth-skips-one",
        "return next(islice(iterable, n, None), default)",
        "return next(islice(iterable, n + 1, None), default)",
        False,
    ),
    Candidate(
        "tail-one-short",
        "yield from islice(iterable, max(0, len(iterable) - n), None)",
        "yield from islice(iterable, max(0, len(iterable) - n + 1), None)",
        False,
    ),
]


def candidates(count: int) -> list[Candidate]:
    """``count`` candidates, alternating refactors and breaking edits, cycling as needed."""
    pool = [c for pair in zip(_REFACTORS, _BREAKS, strict=True) for c in pair]
    return [pool[i % len(pool)] for i in range(count)]


def unified_diff(original: str, candidate: Candidate, path: str = TARGET) -> str:
    """The candidate as a ``git apply``-able unified diff of ``path``.

    Raises ValueError when ``candidate.old`` does not occur exactly once.
    """
    hits = original.count(candidate.old)
    if hits != 1:
        raise ValueError(f"candidate {candidate.name}: expected one match in {path}, found {hits}")
    changed = original.replace(candidate.old, candidate.new)
    return "".join(
        difflib.unified_diff(
            original.splitlines(keepends=True),
            changed.splitlines(keepends=True),
            fromfile=f"a/{path}",
            tofile=f"b/{path}",
        )
    )
