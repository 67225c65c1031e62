"""Defects a fresh user found, kept fixed: cancellation, locks, stale records, auth, limits."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from sandfleet import errors
from sandfleet.cli.local import LocalDeployment
from sandfleet.cli.serve import free_port
from sandfleet.sdk import AsyncClient, Client
from tests.conftest import BUSYBOX_IMAGE, assert_clean

pytestmark = pytest.mark.root


def test_cancelling_an_exec_kills_the_command(deployment: LocalDeployment) -> None:
    async def main() -> None:
        async with (
            AsyncClient(deployment.url) as client,
            await client.create(image=BUSYBOX_IMAGE) as sb,
        ):
            task = asyncio.ensure_future(sb.exec("sleep 31; echo done", timeout_s=60))
            await asyncio.sleep(1.0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                ps = await sb.exec("ps -o args")
                if b"sleep 31" not in ps.stdout:
                    return
                await asyncio.sleep(0.2)
            pytest.fail(f"the cancelled command still runs:\n{ps.stdout_text}")

    asyncio.run(main())


def test_reads_refuse_devices_and_oversized_files(deployment: LocalDeployment) -> None:
    with Client(deployment.url) as client, client.create(image=BUSYBOX_IMAGE) as sb:
        with pytest.raises(errors.InvalidArgument, match="regular file"):
            sb.files.read("/dev/zero")
        sb.exec("ln -s /dev/zero /tmp/zero; mkfifo /tmp/fifo")
        for hidden in ("/tmp/zero", "/tmp/fifo"):  # behind a symlink; a FIFO with no writer
            with pytest.raises(errors.InvalidArgument, match="regular file"):
                sb.files.read(hidden)
            with pytest.raises(errors.InvalidArgument, match="regular file"):
                sb.files.download(hidden, "/dev/null")
        with pytest.raises(errors.InvalidArgument, match="directory"):
            sb.files.read("/tmp")
        sb.exec("head -c 4096 /dev/zero > /tmp/4k")
        with pytest.raises(errors.InvalidArgument, match="download"):
            sb.files.read("/tmp/4k", max_bytes=1024)
        assert len(sb.files.read("/tmp/4k", max_bytes=4096)) == 4096


def test_errors_for_unknown_routes_are_sandfleet_errors(deployment: LocalDeployment) -> None:
    r = httpx.get(f"{deployment.url}/v1/no-such-thing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "NOT_FOUND"
    with Client(deployment.url) as client, pytest.raises(errors.InvalidArgument, match="ttl_s"):
        client.create(image=BUSYBOX_IMAGE, ttl_s=float("nan"))


def test_a_state_dir_serves_one_deployment(tmp_path: Path, images_dir: Path) -> None:
    with LocalDeployment(tmp_path / "state", images_dir) as first:
        second = LocalDeployment(tmp_path / "state", images_dir, ready_timeout_s=10)
        with pytest.raises(errors.Unavailable, match="in use by another"):
            second.start()
        with Client(first.url) as client:
            assert client.run("echo still fine", image=BUSYBOX_IMAGE).stdout == b"still fine\n"
    assert_clean(tmp_path / "state")


def test_records_of_boxes_gone_with_a_stopped_deployment_are_closed(
    tmp_path: Path, images_dir: Path
) -> None:
    state = tmp_path / "state"
    dep = LocalDeployment(state, images_dir).start()
    with Client(dep.url) as client:
        sid = client.create(image=BUSYBOX_IMAGE).id
    dep.stop()  # destroys its sandboxes
    again = LocalDeployment(state, images_dir)
    again.node_id = dep.node_id
    with again, Client(again.url) as client:
        assert [s.id for s in client.list()] == []
        with pytest.raises(errors.NotFound):
            client.get(sid)
    assert_clean(state)


def test_api_token_is_enforced_and_required_off_loopback(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "SANDFLEET_TOKEN": ""}
    cmd = [sys.executable, "-m", "sandfleet.cli", "controlplane", "--state-dir", str(tmp_path)]
    refused = subprocess.run(
        [*cmd, "--host", "0.0.0.0", "--port", str(port)], capture_output=True, text=True, env=env
    )
    assert refused.returncode == 2 and "--api-token" in refused.stderr
    proc = subprocess.Popen(
        [*cmd, "--port", str(port), "--api-token", "s3cret"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                httpx.get(f"{url}/healthz")
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        with Client(url) as client, pytest.raises(errors.Unauthenticated):
            client.list()
        with Client(url, token="s3cret") as client:
            assert client.list() == []
    finally:
        proc.terminate()
        proc.wait(20)


def test_second_tester_defects_stay_fixed(deployment: LocalDeployment) -> None:
    """spawn survives a /tmp clean-up; '/' cannot be removed; a disk bigger than free space."""
    with Client(deployment.url) as client, client.create(image=BUSYBOX_IMAGE) as sb:
        sb.exec("rm -rf /tmp/* /tmp/.[!.]* /run/* /.sandfleet/run/* 2>/dev/null; true")
        p = sb.spawn("echo spawned")
        assert p.wait(timeout_s=10).state == "exited"
        assert p.read_output().data == b"spawned\n"
        with pytest.raises(errors.InvalidArgument, match="root"):
            sb.files.remove("/", recursive=True)
        assert sb.exec("ls /bin/sh").ok
        with pytest.raises(errors.InvalidArgument, match="loop of symlinks"):
            sb.exec("ln -s /tmp/l2 /tmp/l1; ln -s /tmp/l1 /tmp/l2")
            sb.files.read("/tmp/l1")
        st = os.statvfs(deployment.state_dir)
        free_mb, size_mb = st.f_bavail * st.f_frsize >> 20, st.f_blocks * st.f_frsize >> 20
        assert free_mb < size_mb - 64, "the test needs a disk that is not empty"
        with pytest.raises(errors.ResourceExhausted, match="free disk"):
            client.create(image=BUSYBOX_IMAGE, disk_mb=(free_mb + size_mb) // 2)


def test_up_killed_keeps_its_sandboxes_for_the_next_up(tmp_path: Path, images_dir: Path) -> None:
    """A crash of `sandfleet up` is not a stop: its node agent keeps the sandboxes
    (it gets SIGHUP, not SIGTERM), and the next `up` on the state dir adopts them."""
    state = tmp_path / "state"
    dep = LocalDeployment(state, images_dir).start()
    with Client(dep.url) as client:
        sb = client.create(image=BUSYBOX_IMAGE)
        sb.exec("echo kept > /root/mark")
    dep.kill()
    again = LocalDeployment(state, images_dir)
    again.node_id = dep.node_id
    with again, Client(again.url) as client:
        assert client.get(sb.id).exec("cat /root/mark").stdout == b"kept\n"
    assert_clean(state)


def test_up_starts_a_dead_node_agent_again(deployment: LocalDeployment) -> None:
    with Client(deployment.url) as client:
        sb = client.create(image=BUSYBOX_IMAGE)
        node = [
            int(p.name)
            for p in Path("/proc").iterdir()
            if p.name.isdigit()
            and f"--node-id\0{deployment.node_id}\0".encode() in _cmdline(p)
            and b"\0node\0" in _cmdline(p)
        ]
        assert len(node) == 1, node
        os.kill(node[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while True:
            try:
                assert sb.exec("echo alive").stdout == b"alive\n"
                break
            except (errors.Unavailable, errors.NotFound):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)


def _cmdline(proc: Path) -> bytes:
    try:
        return b"\0" + (proc / "cmdline").read_bytes()
    except OSError:
        return b""
