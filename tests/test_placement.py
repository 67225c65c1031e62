"""Placement is a pure function: tested over snapshots, no network."""

from __future__ import annotations

import random
from collections import Counter

from sandfleet.controlplane.placement import Infeasible, NodeLoad, Placed, Retry, place


def node(node_id: str, sandboxes: int = 0, mem_reserved: int = 0, **kw: object) -> NodeLoad:
    args: dict[str, object] = dict(
        node_id=node_id,
        kinds=("container",),
        healthy=True,
        max_sandboxes=10,
        cpu=2.0,
        memory_mb=4096,
        sandboxes=sandboxes,
        memory_mb_reserved=mem_reserved,
    )
    args.update(kw)
    return NodeLoad(**args)  # type: ignore[arg-type]


def test_two_choices_prefers_the_less_loaded_node() -> None:
    nodes = [node("a", sandboxes=9), node("b", sandboxes=1)]
    for seed in range(20):
        assert place(
            nodes, kind="container", cpu=1, memory_mb=100, rng=random.Random(seed)
        ) == Placed("b")


def test_spreads_over_equal_nodes() -> None:
    nodes = [node(f"n{i}") for i in range(4)]
    rng = random.Random(1)
    hits = Counter()
    for _ in range(400):
        decision = place(nodes, kind="container", cpu=1, memory_mb=100, rng=rng)
        assert isinstance(decision, Placed)
        hits[decision.node_id] += 1
    assert set(hits) == {"n0", "n1", "n2", "n3"}


def test_full_nodes_mean_retry_not_infeasible() -> None:
    nodes = [node("a", sandboxes=10), node("b", mem_reserved=4000)]
    decision = place(nodes, kind="container", cpu=1, memory_mb=512)
    assert isinstance(decision, Retry)
    assert "full" in decision.reason


def test_excluded_nodes_are_skipped() -> None:
    nodes = [node("a"), node("b", sandboxes=5)]
    assert place(nodes, kind="container", cpu=1, memory_mb=1, exclude=frozenset({"a"})) == Placed(
        "b"
    )


def test_impossible_memory_is_infeasible_and_says_the_largest() -> None:
    decision = place([node("a")], kind="container", cpu=1, memory_mb=10**6)
    assert isinstance(decision, Infeasible)
    assert "4096" in decision.reason


def test_kind_and_health_filters() -> None:
    assert isinstance(
        place([node("a", healthy=False)], kind="container", cpu=1, memory_mb=1), Retry
    )
    decision = place([node("a")], kind="vm", cpu=1, memory_mb=1)
    assert isinstance(decision, Infeasible)
    assert "container" in decision.reason
