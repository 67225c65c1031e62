"""Placement as a pure function over a snapshot of node loads.

Filter (healthy, offers the kind, could ever fit the request), then
power-of-k-choices: sample k candidates that have room now and take the least
loaded (Mitzenmacher, "The Power of Two Choices in Randomized Load
Balancing", 2001). No I/O here, so it is tested without a network.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["Infeasible", "NodeLoad", "Placed", "Retry", "place"]


@dataclass(frozen=True)
class NodeLoad:
    """One node's capacity and current reservations (cores, MiB, sandboxes)."""

    node_id: str
    kinds: tuple[str, ...]
    healthy: bool
    max_sandboxes: int
    cpu: float
    memory_mb: int
    sandboxes: int = 0
    cpu_reserved: float = 0.0
    memory_mb_reserved: int = 0

    def fits_ever(self, cpu: float, memory_mb: int) -> bool:
        return self.max_sandboxes > 0 and memory_mb <= self.memory_mb

    def fits_now(self, memory_mb: int) -> bool:
        return (
            self.sandboxes < self.max_sandboxes
            and self.memory_mb_reserved + memory_mb <= self.memory_mb
        )

    @property
    def load(self) -> float:
        """The busiest dimension as a fraction of capacity (CPU may be overcommitted)."""
        return max(
            self.sandboxes / max(self.max_sandboxes, 1),
            self.memory_mb_reserved / max(self.memory_mb, 1),
            self.cpu_reserved / max(self.cpu, 1e-9) / 4,
        )


@dataclass(frozen=True)
class Placed:
    node_id: str


@dataclass(frozen=True)
class Retry:
    """Some node could host it, but none has room now: retryable."""

    reason: str


@dataclass(frozen=True)
class Infeasible:
    """No node could ever host it: the request must change."""

    reason: str


def place(
    nodes: list[NodeLoad],
    *,
    kind: str,
    cpu: float,
    memory_mb: int,
    k: int = 2,
    exclude: frozenset[str] = frozenset(),
    rng: random.Random | None = None,
) -> Placed | Retry | Infeasible:
    """Choose a node for a sandbox of ``kind`` needing ``cpu`` cores and ``memory_mb`` MiB.

    ``exclude`` holds nodes that already refused this request.
    """
    rng = rng or random.Random()
    healthy = [n for n in nodes if n.healthy]
    if not healthy:
        return Retry("no healthy node is registered; start one with `sandfleet node` or `up`")
    offering = [n for n in healthy if kind in n.kinds]
    if not offering:
        offered = sorted({k for n in healthy for k in n.kinds})
        return Infeasible(f"no node offers kind {kind!r}; nodes offer {offered}")
    possible = [n for n in offering if n.fits_ever(cpu, memory_mb)]
    if not possible:
        biggest = max(n.memory_mb for n in offering)
        return Infeasible(
            f"memory_mb={memory_mb} exceeds every node's capacity (largest: {biggest} MiB)"
        )
    free = [n for n in possible if n.node_id not in exclude and n.fits_now(memory_mb)]
    if not free:
        return Retry(f"all {len(possible)} node(s) able to host this sandbox are full")
    sample = rng.sample(free, min(k, len(free)))
    best = min(sample, key=lambda n: n.load)  # ties go to the random sample order
    return Placed(best.node_id)
