"""A control plane with two node agents on one machine: placement, refusal and retry."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from sandfleet import errors
from sandfleet.cli.serve import free_port
from sandfleet.sdk import Client
from tests.conftest import BUSYBOX_IMAGE, assert_clean

pytestmark = pytest.mark.root

TOKEN = "test-cluster-token"


@dataclass
class Cluster:
    url: str
    state: Path
    node_urls: dict[str, str]


def _start(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(log, "ab") as fh:
        return subprocess.Popen(
            [sys.executable, "-m", "sandfleet.cli", *args],
            stdout=fh,
            stderr=fh,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "SANDFLEET_NODE_TOKEN": TOKEN, **env},
        )


@pytest.fixture
def cluster(tmp_path: Path, images_dir: Path) -> Iterator[Cluster]:
    """A control plane plus node-a (room for 2) and node-b (room for 50).

    Heartbeats are slowed to 60 s so the control plane's view of node loads is
    stale, as it is between heartbeats under burst load.
    """
    state = tmp_path / "state"
    cp_port = free_port()
    url = f"http://127.0.0.1:{cp_port}"
    common = ["--state-dir", str(state), "--images-dir", str(images_dir)]
    slow = {"SANDFLEET_HEARTBEAT_INTERVAL_S": "60"}
    procs = [_start(["controlplane", *common, "--port", str(cp_port)], tmp_path / "cp.log", {})]
    node_urls = {}
    for node_id, room in (("node-a", 2), ("node-b", 50)):
        port = free_port()
        node_urls[node_id] = f"http://127.0.0.1:{port}"
        procs.append(
            _start(
                [
                    "node",
                    *common,
                    "--node-id",
                    node_id,
                    "--control-plane",
                    url,
                    "--port",
                    str(port),
                    "--max-sandboxes",
                    str(room),
                ],
                tmp_path / f"{node_id}.log",
                slow,
            )
        )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                nodes = httpx.get(f"{url}/v1/nodes", timeout=1).json()["nodes"]
                if sum(n["healthy"] for n in nodes) == 2:
                    break
            except (httpx.HTTPError, KeyError):
                pass
            time.sleep(0.2)
        else:
            logs = "\n".join(p.read_text() for p in tmp_path.glob("*.log"))
            pytest.fail(f"cluster did not come up:\n{logs[-4000:]}")
        yield Cluster(url, state, node_urls)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
    assert_clean(state)


def _refusals(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    m = re.search(r"^sandfleet_placement_refusals (\S+)$", text, re.M)
    assert m, text
    return float(m.group(1))


def test_full_node_refuses_and_placement_retries(cluster: Cluster) -> None:
    auth = {"authorization": f"Bearer {TOKEN}"}
    node_a = cluster.node_urls["node-a"]
    # Fill node-a behind the control plane's back, so its view of node-a is stale.
    direct = [f"sb-00000000000{i}-node-a" for i in range(2)]
    for sid in direct:
        r = httpx.post(
            f"{node_a}/v1/sandboxes",
            headers=auth,
            timeout=60,
            json={"id": sid, "image": BUSYBOX_IMAGE, "memory_mb": 64},
        )
        assert r.status_code == 201, r.text
    r = httpx.post(
        f"{node_a}/v1/sandboxes",
        headers=auth,
        timeout=60,
        json={"id": "sb-000000000009-node-a", "image": BUSYBOX_IMAGE},
    )
    assert r.json()["error"]["code"] == "RESOURCE_EXHAUSTED"
    try:
        with Client(cluster.url) as client:
            boxes = [client.create(image=BUSYBOX_IMAGE, memory_mb=64) for _ in range(4)]
            assert [b.info.node_id for b in boxes] == ["node-b"] * 4
            # Once node-b looked busier, placement chose node-a, which refused; it retried.
            assert _refusals(cluster.url) >= 1
            for b in boxes:
                assert b.id.endswith("-node-b")
                assert b.exec("echo routed").stdout == b"routed\n"
                b.destroy()
            assert client.list() == []
    finally:
        for sid in direct:
            httpx.delete(f"{node_a}/v1/sandboxes/{sid}", headers=auth, timeout=60)


def test_spread_and_exhaustion(cluster: Cluster) -> None:
    with Client(cluster.url) as client:
        boxes = [client.create(image=BUSYBOX_IMAGE, memory_mb=64) for _ in range(6)]
        try:
            per_node = {n: sum(b.info.node_id == n for b in boxes) for n in ("node-a", "node-b")}
            assert per_node["node-a"] >= 1 and per_node["node-b"] >= 1
        finally:
            for b in boxes:
                b.destroy()
        with pytest.raises(errors.InvalidArgument, match="capacity"):
            client.create(image=BUSYBOX_IMAGE, memory_mb=10**6)


def test_nodes_need_the_cluster_token(cluster: Cluster) -> None:
    r = httpx.post(
        f"{cluster.url}/v1/nodes/register", json={}, headers={"authorization": "Bearer x"}
    )
    assert r.status_code == 401 and r.json()["error"]["code"] == "UNAUTHENTICATED"
    r = httpx.get(f"{cluster.node_urls['node-a']}/v1/sandboxes")
    assert r.status_code == 401
