"""The whole path: SDK → control plane → node agent → runc container → in-sandbox agent."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from pathlib import Path

import httpx
import pytest

from sandfleet import errors
from sandfleet.cli.local import LocalDeployment
from sandfleet.sdk import AsyncClient, Client
from tests.conftest import BUSYBOX_IMAGE

pytestmark = pytest.mark.root


def test_create_exec_files_destroy_sync(deployment: LocalDeployment) -> None:
    with Client(deployment.url) as client:
        with client.create(image=BUSYBOX_IMAGE, memory_mb=128, labels={"job": "t1"}) as sb:
            r = sb.exec("printf '\\342'; printf 'a\\0b\\0' >&2; exit 3")
            assert (r.status, r.exit_code, r.stdout, r.stderr) == ("exited", 3, b"\xe2", b"a\0b\0")
            assert sb.exec(["cat"]).stdout == b""
            assert sb.exec(["cat"], stdin=b"in\x00put").stdout == b"in\x00put"
            assert sb.exec("echo $V", env={"V": "it's ü"}).stdout == "it's ü\n".encode()
            assert sb.exec("pwd", cwd="/work dir").stdout == b"/work dir\n"
            t0 = time.monotonic()
            slow = sb.exec("echo early; sleep 10", timeout_s=1)
            assert slow.status == "timeout" and slow.exit_code is None
            assert slow.stdout == b"early\n" and time.monotonic() - t0 < 4
            missing = sb.exec(["no-such-command"])
            assert missing.exit_code == 127 and missing.stderr

            blob = os.urandom(1 << 20)
            sb.files.write("/tmp/blob", blob)
            assert sb.files.read("/tmp/blob") == blob
            sb.files.write("/tmp/empty", b"")
            assert sb.files.read("/tmp/empty") == b""
            assert sb.files.stat("/tmp/blob").size == 1 << 20
            assert {"blob", "empty"} <= {e.name for e in sb.files.list("/tmp")}
            sb.files.mkdir("/tmp/a/b")
            sb.files.remove("/tmp/a", recursive=True)
            with pytest.raises(errors.NotFound):
                sb.files.read("/tmp/a/b")
            assert [s.id for s in client.list(labels={"job": "t1"})] == [sb.id]
            sid = sb.id
        with pytest.raises(errors.NotFound):
            client.get(sid).exec("true")


def test_upload_download_stream(deployment: LocalDeployment, tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(5 * (1 << 20) + 7))
    with Client(deployment.url) as client, client.create(image=BUSYBOX_IMAGE) as sb:
        sb.files.upload(src, "/root/src.bin")
        digest = sb.exec(["sha256sum", "/root/src.bin"]).stdout.split()[0].decode()
        assert digest == hashlib.sha256(src.read_bytes()).hexdigest()
        n = sb.files.download("/root/src.bin", tmp_path / "back.bin")
        assert n == src.stat().st_size
        assert (tmp_path / "back.bin").read_bytes() == src.read_bytes()


def test_clear_errors(deployment: LocalDeployment) -> None:
    with Client(deployment.url) as client:
        with pytest.raises(errors.NotFound, match=BUSYBOX_IMAGE):
            client.create(image="no/such-image:1")
        with pytest.raises(errors.InvalidArgument, match="memory_mb"):
            client.create(image=BUSYBOX_IMAGE, memory_mb=1)
        with pytest.raises(errors.InvalidArgument, match="microvm"):
            client.create(kind="vmm", image=BUSYBOX_IMAGE)  # the error lists the kinds
        with pytest.raises(errors.NotFound):
            client.get("sb-000000000000-local")
        with client.create(image=BUSYBOX_IMAGE) as sb, pytest.raises(errors.InvalidArgument):
            sb.exec("pwd", cwd="/no/such/dir")


def test_burst_of_100_creates_async(deployment: LocalDeployment) -> None:
    """CASES K9: 100 creates at once; each succeeds or fails retryably; nothing is left."""

    async def main() -> None:
        async with AsyncClient(deployment.url) as client:

            async def one(i: int) -> bytes | None:
                try:
                    sb = await client.create(image=BUSYBOX_IMAGE, memory_mb=64, labels={"b": "1"})
                except errors.SandfleetError as exc:
                    assert exc.retryable, exc
                    return None
                async with sb:
                    return (await sb.exec(f"echo {i}")).stdout

            outs = await asyncio.gather(*(one(i) for i in range(100)))
            done = [(i, o) for i, o in enumerate(outs) if o is not None]
            assert len(done) >= 90
            assert all(o == f"{i}\n".encode() for i, o in done)
            assert await client.list(labels={"b": "1"}) == []

    asyncio.run(main())


def test_oom_is_reported_and_the_sandbox_survives(deployment: LocalDeployment) -> None:
    with Client(deployment.url) as client, client.create(image=BUSYBOX_IMAGE, memory_mb=64) as sb:
        hog = sb.exec("dd if=/dev/zero of=/dev/null bs=160M count=1", timeout_s=30)
        assert hog.status == "oom", hog
        assert sb.exec("echo alive").stdout == b"alive\n"


def test_run_one_shot_and_ttl(deployment: LocalDeployment) -> None:
    with Client(deployment.url) as client:
        assert client.run("echo hi", image=BUSYBOX_IMAGE).stdout == b"hi\n"
        assert client.list() == []
        sb = client.create(image=BUSYBOX_IMAGE, ttl_s=1)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and client.list():
            time.sleep(0.5)
        assert client.list() == []
        with pytest.raises(errors.NotFound):
            sb.exec("true")


def test_isolation_inside_the_container(deployment: LocalDeployment) -> None:
    with (
        Client(deployment.url) as client,
        client.create(image=BUSYBOX_IMAGE) as a,
        client.create(image=BUSYBOX_IMAGE) as b,
    ):
        links = a.exec("cat /proc/net/dev").stdout_text
        assert "lo:" in links and "eth" not in links
        # The control plane answers from the host; from inside, its port is not there.
        assert httpx.get(f"http://127.0.0.1:{deployment.port}/healthz").status_code == 200
        probe = a.exec(f"nc -w 2 127.0.0.1 {deployment.port} </dev/null")
        assert (probe.status, probe.exit_code) == ("exited", 1), probe
        # ...while the same probe reaches a port that is open inside the sandbox.
        ok = a.exec("nc -l -p 9999 </dev/null & sleep 0.2; echo hi | nc -w 2 127.0.0.1 9999")
        assert ok.exit_code == 0, ok
        assert a.exec(["cat", "/proc/kcore"]).exit_code != 0
        a.exec("rm /bin/sh; echo gone > /bin/sh")
        assert b.exec(["/bin/sh", "-c", "echo still here"]).stdout == b"still here\n"


def test_openapi_is_published_and_versioned(deployment: LocalDeployment) -> None:
    spec = httpx.get(f"{deployment.url}/openapi.json").json()
    paths = set(spec["paths"])
    assert {
        "/v1/sandboxes",
        "/v1/sandboxes/{sandbox_id}",
        "/v1/sandboxes/{sandbox_id}/exec",
    } <= paths
    # Versioned, apart from the SandboxFusion-compatible endpoint, whose path is its protocol's.
    fusion = {"/run_code", "/token/{token}/run_code"}
    assert fusion <= paths
    assert all(p.startswith(("/v1/", "/healthz", "/metrics")) for p in paths - fusion)
    metrics = httpx.get(f"{deployment.url}/metrics").text
    assert "sandfleet_sandboxes_created" in metrics
