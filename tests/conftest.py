"""Shared fixtures: real images, real servers on free ports, and leak checks."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sandfleet.cli.local import LocalDeployment
from sandfleet.images import ImageStore, build_from_directory, busybox_tree
from sandfleet.node.leaks import leftovers
from sandfleet.sdk import Client
from sandfleet.wire.models import RunResult

#: Debian images take a minute to build; tests keep them here between runs.
CACHE_DIR = Path(os.environ.get("SANDFLEET_TEST_CACHE", "/var/tmp/sandfleet-test-cache"))
BUSYBOX_IMAGE = "test/busybox:1"


def _busybox_tree(root: Path) -> None:
    busybox_tree(root)
    (root / "work dir").mkdir()  # a workdir with a space, for the tests of cwd


@pytest.fixture(scope="session")
def images_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A session image store holding a small busybox image (built in about a second)."""
    root = tmp_path_factory.mktemp("images")
    tree = tmp_path_factory.mktemp("busybox-tree")
    _busybox_tree(tree)
    build_from_directory(ImageStore(root), BUSYBOX_IMAGE, tree)
    return root


@pytest.fixture(scope="session")
def demo_images_dir() -> Path:
    """The demo's Debian base and more-itertools workspace, built once and cached."""
    from rich.console import Console

    from sandfleet.cli.demo import ensure_demo_images

    root = CACHE_DIR / "images"
    ensure_demo_images(root, Console(stderr=True))
    return root


@pytest.fixture(scope="session")
def fncall_images_dir() -> Path:
    """The fncall image (Debian with python3, bash, gcc, g++), built once and cached."""
    import sys

    from sandfleet.fncall.images import ensure_fncall_image

    root = CACHE_DIR / "images"
    ensure_fncall_image(root, sys.stderr)
    return root


class FnClient(Client):
    """A Client whose ``run`` defaults to ``kind="fncall"`` (the SDK's default is a sandbox)."""

    def run(self, code: Any, **kwargs: Any) -> RunResult:
        kwargs.setdefault("kind", "fncall")
        return super().run(code, **kwargs)


@pytest.fixture(scope="module")
def fncall_dep(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    fncall_images_dir: Path,
) -> Iterator[LocalDeployment]:
    """One real `sandfleet up` with the fncall image per module; its node must be clean after."""
    name = request.module.__name__.rpartition(".")[2]
    state = tmp_path_factory.mktemp(name) / "state"
    with LocalDeployment(state, fncall_images_dir) as dep:
        yield dep
    assert_clean(dep.state_dir)


@pytest.fixture
def nginx_store(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A real nginx on a free port serving an empty directory as a writable blob store
    (WebDAV PUT/DELETE, JSON autoindex): yields ``(url, root_dir)``."""
    from tests.nginx import nginx_server

    root = tmp_path / "nginx-root"
    root.mkdir()
    with nginx_server(root) as url:
        yield url, root


@pytest.fixture
def deployment(tmp_path: Path, images_dir: Path) -> Iterator[LocalDeployment]:
    """A real `sandfleet up` on free ports; after the test, nothing may be left on its node."""
    with LocalDeployment(tmp_path / "state", images_dir) as dep:
        yield dep
    assert_clean(dep.state_dir)


def assert_clean(state_dir: Path) -> None:
    left = leftovers(state_dir)
    assert not left, "left behind: " + "; ".join(left)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Root-marked tests need root; off CI they are skipped for others, in CI they must run."""
    if os.geteuid() == 0:
        return
    if os.environ.get("CI"):
        raise pytest.UsageError("CI runs the root-marked tests: run the suite as root")
    skip = pytest.mark.skip(reason="needs root (runc, mounts, cgroups); CI runs it as root")
    for item in items:
        if "root" in item.keywords:
            item.add_marker(skip)
