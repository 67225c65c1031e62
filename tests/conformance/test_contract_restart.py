"""Leaks when the node agent dies: killed mid-create, or while sandboxes run, then restarted."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from sandfleet import errors
from sandfleet.cli.local import LocalDeployment
from sandfleet.sdk import Client
from tests.conftest import BUSYBOX_IMAGE, assert_clean

pytestmark = pytest.mark.root


def _node_agent_pid(dep: LocalDeployment) -> int:
    """The `sandfleet node` child of a `sandfleet up`."""
    assert dep._proc is not None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        if ppid == dep._proc.pid and b"node" in cmdline:
            return int(entry.name)
    raise AssertionError("no node agent child found")


def _restart(dep: LocalDeployment) -> LocalDeployment:
    dep.stop()
    again = LocalDeployment(dep.state_dir, dep.images_dir)
    again.node_id = dep.node_id  # the same node, adopting what survived
    return again.start()


@pytest.mark.parametrize("delay_s", [0.0, 0.01, 0.03, 0.08])
def test_node_agent_killed_during_create_leaves_nothing(
    kind: str, tmp_path: Path, images_dir: Path, delay_s: float
) -> None:
    """A SIGKILL of the node agent at any point of a create: after a restart, nothing is left."""
    dep = LocalDeployment(tmp_path / "state", images_dir).start()
    outcome: list[object] = []

    def create() -> None:
        with Client(dep.url) as client:
            try:
                outcome.append(client.create(kind=kind, image=BUSYBOX_IMAGE).id)
            except errors.SandfleetError as exc:
                outcome.append(exc)

    worker = threading.Thread(target=create)
    worker.start()
    time.sleep(0.15 + delay_s)  # the request reaches the node after ~0.1 s
    os.kill(_node_agent_pid(dep), signal.SIGKILL)
    worker.join(60)
    dep = _restart(dep)
    try:
        with Client(dep.url) as client:
            survivors = client.list()
            if isinstance(outcome[0], str) and survivors:
                # It finished before the kill: adopted, and still works.
                assert [s.id for s in survivors] == [outcome[0]]
                assert client.get(outcome[0]).exec("echo adopted").stdout == b"adopted\n"
                client.get(outcome[0]).destroy()
            assert client.list() == []
    finally:
        dep.stop()
    assert_clean(dep.state_dir)


def test_node_agent_killed_while_sandboxes_run_adopts_them(
    kind: str, tmp_path: Path, images_dir: Path
) -> None:
    """Sandboxes outlive a crashed node agent; its successor adopts them; then destroy is clean."""
    dep = LocalDeployment(tmp_path / "state", images_dir).start()
    with Client(dep.url) as client:
        boxes = [client.create(kind=kind, image=BUSYBOX_IMAGE) for _ in range(3)]
        boxes[0].files.write("/root/state", b"kept")
    os.kill(_node_agent_pid(dep), signal.SIGKILL)
    dep = _restart(dep)
    try:
        with Client(dep.url) as client:
            assert sorted(s.id for s in client.list()) == sorted(b.id for b in boxes)
            again = client.get(boxes[0].id)
            assert again.files.read("/root/state") == b"kept"
            assert again.exec("echo alive").stdout == b"alive\n"
            for b in boxes:
                client.get(b.id).destroy()
    finally:
        dep.stop()
    assert_clean(dep.state_dir)
