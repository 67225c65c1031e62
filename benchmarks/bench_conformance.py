"""Wall time of the conformance suite, once per built isolation kind.

For each kind in ``sandfleet.wire.models.BUILT_KINDS`` runs
``python -m pytest -q -p no:cacheprovider tests/conformance -k <kind>`` as a
subprocess from the repository root (with ``--durations=5``) and prints a table:
kind, tests passed / failed / skipped / errors (from pytest's summary line) and
wall seconds, then each kind's 5 slowest test phases as pytest reports them.
Nothing is asserted; pytest's own output is shown only for a kind whose run failed.

Run as root (the suite starts real deployments):
``python benchmarks/bench_conformance.py [-- extra pytest args]``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from sandfleet.wire.models import BUILT_KINDS

ROOT = Path(__file__).resolve().parent.parent
OUTCOMES = ("passed", "failed", "skipped", "error", "deselected")


def summary(output: str) -> dict[str, int]:
    """Counts from pytest's last summary line, e.g. ``12 passed, 1 failed in 3.2s``."""
    counts = dict.fromkeys(OUTCOMES, 0)
    for line in reversed(output.splitlines()):
        found = re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", line)
        if found:
            for n, what in found:
                counts[what.rstrip("s") if what.startswith("error") else what] += int(n)
            break
    return counts


def slowest(output: str) -> list[str]:
    """The ``--durations`` lines: ``12.34s call     tests/...::test_x[kind]``."""
    return [
        " ".join(line.split())
        for line in output.splitlines()
        if re.match(r"^\d+\.\d+s (call|setup|teardown) ", line)
    ]


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("pytest_args", nargs="*", help="passed on to pytest (after --)")
    args = ap.parse_args()
    console = Console()
    console = console if console.is_terminal else Console(width=140)
    console.print(f"conformance suite per kind, {os.cpu_count()} cores, loadavg {loadavg()}")
    table = Table(
        "kind",
        "passed",
        "failed",
        "skipped",
        "errors",
        "wall",
        title="conformance",
        title_justify="left",
    )
    worst = 0
    durations: dict[str, list[str]] = {}
    for kind in BUILT_KINDS:
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/conformance",
            "-k",
            kind,
            "--durations=5",
            *args.pytest_args,
        ]
        t0 = time.perf_counter()
        proc = subprocess.run(
            cmd, cwd=ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False
        )
        wall = time.perf_counter() - t0
        c = summary(proc.stdout)
        durations[kind] = slowest(proc.stdout)
        table.add_row(
            kind,
            str(c["passed"]),
            str(c["failed"]),
            str(c["skipped"]),
            str(c["error"]),
            f"{wall:.1f} s",
        )
        if proc.returncode != 0:
            worst = max(worst, proc.returncode)
            console.print(f"[red]{kind}: pytest exited {proc.returncode}[/]; its output:")
            console.print(proc.stdout[-6000:] + proc.stderr[-2000:], markup=False)
    console.print(table)
    for kind, lines in durations.items():
        console.print(f"{kind}: slowest test phases", *(f"  {x}" for x in lines), sep="\n")
    console.print(f"loadavg at the end: {loadavg()}")
    return worst


if __name__ == "__main__":
    sys.exit(main())
