"""Fixtures of the conformance suite: one deployment per module, sandboxes of every built kind.

Every test gets a :class:`Fleet` that creates sandboxes of the parametrised
``kind`` and remembers them; after the test it destroys what is still alive and
checks that none of them left a process, mount, cgroup, runc container or
state directory on the node.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sandfleet import errors
from sandfleet.cli.local import LocalDeployment
from sandfleet.node.leaks import leftovers
from sandfleet.sdk import Client, Sandbox
from sandfleet.wire.models import BUILT_KINDS
from tests.conftest import BUSYBOX_IMAGE, assert_clean


@pytest.fixture(scope="module", params=BUILT_KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    """Each isolation kind this release can run; every test runs once per kind."""
    return str(request.param)


@pytest.fixture(scope="module")
def shared_deployment(
    tmp_path_factory: pytest.TempPathFactory, images_dir: Path
) -> Iterator[LocalDeployment]:
    """One real `sandfleet up` per test module; the whole node must be clean after it."""
    state = tmp_path_factory.mktemp("conformance") / "state"
    with LocalDeployment(state, images_dir) as dep:
        yield dep
    assert_clean(dep.state_dir)


def processes_of(ids: set[str]) -> list[str]:
    """Host processes still in the cgroup of one of the sandboxes ``ids``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cgroups = (entry / "cgroup").read_text()
        except OSError:
            continue
        hits = sorted(i for i in ids if i in cgroups)
        if hits:
            found.append(f"process {entry.name} in the cgroup of {hits[0]}")
    return found


class Fleet:
    """Creates sandboxes of one kind from a shared deployment and tracks them."""

    def __init__(self, deployment: LocalDeployment, kind: str) -> None:
        self.deployment = deployment
        self.kind = kind
        self.url = deployment.url
        self.client = Client(deployment.url)
        self.ids: set[str] = set()

    def create(self, **kwargs: Any) -> Sandbox:
        """A new sandbox of this fleet's kind (busybox image, 128 MiB unless given)."""
        kwargs.setdefault("image", BUSYBOX_IMAGE)
        kwargs.setdefault("memory_mb", 128)
        kwargs.setdefault("ttl_s", 600)
        sandbox = self.client.create(kind=self.kind, **kwargs)
        self.ids.add(sandbox.id)
        return sandbox

    def track(self, sandbox_id: str) -> None:
        """Remember a sandbox created through another client (e.g. an AsyncClient)."""
        self.ids.add(sandbox_id)

    def traces(self) -> list[str]:
        """What the tracked sandboxes left on the node; empty means clean."""
        state = self.deployment.state_dir
        return leftovers(state, only=self.ids) + processes_of(self.ids)

    def close(self) -> list[str]:
        """Destroy every tracked sandbox still alive and return what they left behind."""
        for sid in self.ids:
            with contextlib.suppress(errors.NotFound):
                self.client.get(sid).destroy()
        self.client.close()
        return self.traces()


@pytest.fixture
def fleet(shared_deployment: LocalDeployment, kind: str) -> Iterator[Fleet]:
    """Sandboxes of ``kind``; after the test none of them may leave a trace on the node."""
    f = Fleet(shared_deployment, kind)
    try:
        yield f
    finally:
        left = f.close()
    assert not left, "left behind: " + "; ".join(left)


@pytest.fixture
def sandbox(fleet: Fleet) -> Sandbox:
    """One sandbox of the parametrised kind (busybox, 128 MiB)."""
    return fleet.create()


def host_probe_name() -> str:
    """A file name that exists nowhere yet, for checks that the host is untouched."""
    return f"sf-probe-{os.urandom(6).hex()}"
