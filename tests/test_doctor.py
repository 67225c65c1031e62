"""`sandfleet doctor` probes the host for real."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sandfleet.node.doctor import kinds_offered, run_checks

pytestmark = pytest.mark.root


def test_doctor_finds_what_containers_need() -> None:
    checks = {c.name: c for c in run_checks()}
    for needed in ("cgroups", "overlayfs", "EROFS file-backed mount", "runc", "mkfs.erofs"):
        assert checks[needed].ok, checks[needed]
    assert checks["cgroups"].detail.split(";")[0] in ("v1", "v2", "hybrid")
    kinds = kinds_offered(list(checks.values()))
    assert kinds["container"] == "available"
    # the probe decides the accelerator: on hosts where nested KVM hangs, TCG, said so
    accel = checks["vm acceleration"]
    assert accel.ok and accel.detail.split(" ")[0] in ("kvm", "tcg"), accel
    for kind in ("microvm", "vm"):
        assert kinds[kind].startswith("available, "), kinds[kind]
        assert ("TCG" in kinds[kind]) == accel.detail.startswith("tcg")


def test_doctor_command_prints_a_table() -> None:
    env = {**os.environ, "COLUMNS": "160"}
    cmd = [sys.executable, "-m", "sandfleet.cli", "doctor"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    assert "EROFS file-backed mount" in out.stdout and "container" in out.stdout
