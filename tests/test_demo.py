"""The main job on real input: the rollout demo on a debootstrapped Debian image."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.root, pytest.mark.slow]


def test_demo_rollouts_score_every_patch_and_leave_nothing(
    demo_images_dir: Path, tmp_path: Path
) -> None:
    out = subprocess.run(
        [
            sys.executable, "-m", "sandfleet.cli", "demo", "rollouts",
            "--state-dir", str(tmp_path), "--images-dir", str(demo_images_dir),
            "--rollouts", "16", "--concurrency", "8",
        ],
        capture_output=True, text=True, timeout=900, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "16/16 rewards match the patch labels" in out.stdout
    assert "mean reward 0.50" in out.stdout
    assert "node clean" in out.stdout


def test_demo_survives_its_driver_being_preempted(demo_images_dir: Path, tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable, "-m", "sandfleet.cli", "demo", "rollouts", "--preempt",
            "--state-dir", str(tmp_path), "--images-dir", str(demo_images_dir),
            "--rollouts", "9", "--concurrency", "3",
        ],
        capture_output=True, text=True, timeout=900, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "driver 1 stopped after" in out.stdout
    same = re.search(r"(\d+)/(\d+) rollouts finished by driver 1 got the same", out.stdout)
    assert same and same[1] == same[2] and int(same[1]) >= 3, out.stdout[-3000:]
    assert "9/9 rewards match the patch labels" in out.stdout
    assert "node clean" in out.stdout
