"""Conformance: bursts, parallel calls and destroys leave nothing behind (CASES K9)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from sandfleet import errors
from sandfleet.node.leaks import leftovers
from sandfleet.sdk import AsyncClient, Sandbox
from sandfleet.wire.models import ExecResult
from tests.conformance.conftest import Fleet
from tests.conftest import BUSYBOX_IMAGE

pytestmark = pytest.mark.root


def test_a_burst_of_100_sandboxes_leaves_nothing(fleet: Fleet) -> None:
    """K9: 100 creates at once; each succeeds or fails retryably; after destroy nothing remains."""
    label = {"burst": fleet.kind}

    async def main() -> list[bytes | None]:
        async with AsyncClient(fleet.url) as client:

            async def one(i: int) -> bytes | None:
                try:
                    sb = await client.create(
                        kind=fleet.kind, image=BUSYBOX_IMAGE, memory_mb=64, labels=label
                    )
                except errors.SandfleetError as exc:
                    assert exc.retryable, exc
                    return None
                fleet.track(sb.id)
                async with sb:
                    return (await sb.exec(["echo", f"ok {i}"])).stdout

            outs = await asyncio.gather(*(one(i) for i in range(100)))
            assert await client.list(labels=label) == []
            return outs

    outs = asyncio.run(main())
    done = [(i, o) for i, o in enumerate(outs) if o is not None]
    assert len(done) >= 90, f"only {len(done)} of 100 creates succeeded"
    assert all(o == f"ok {i}\n".encode() for i, o in done)
    assert leftovers(fleet.deployment.state_dir, only=fleet.ids) == []
    assert fleet.client.list() == []


def test_parallel_calls_in_one_sandbox_do_not_mix(fleet: Fleet, sandbox: Sandbox) -> None:
    """K9: 20 concurrent execs and file writes in one sandbox each get exactly their own data."""

    async def main(client: AsyncClient) -> None:
        sb = await client.get(sandbox.id)

        async def one(i: int) -> None:
            payload = f"{i}-".encode() * 5000
            await sb.files.write(f"/tmp/f{i}", payload)
            r = await sb.exec(f"sleep 0.{i % 5}; cat /tmp/f{i}; echo err{i} >&2; exit {i}")
            assert (r.status, r.exit_code) == ("exited", i)
            assert r.stdout == payload and r.stderr == f"err{i}\n".encode()

        await asyncio.gather(*(one(i) for i in range(20)))

    async def run() -> None:
        async with AsyncClient(fleet.url) as client:
            await main(client)

    asyncio.run(run())


def test_destroy_during_a_running_exec(fleet: Fleet) -> None:
    """K9: destroying a sandbox while a command runs ends the call promptly and leaks nothing."""
    sb = fleet.create()
    sb.exec("sleep 109 & exit 0")
    outcome: dict[str, object] = {}

    def hang() -> None:
        t0 = time.monotonic()
        try:
            outcome["r"] = sb.exec("sleep 60", timeout_s=60)
        except errors.SandfleetError as exc:
            outcome["r"] = exc
        outcome["t"] = time.monotonic() - t0

    thread = threading.Thread(target=hang)
    thread.start()
    time.sleep(1)
    t0 = time.monotonic()
    fleet.client.get(sb.id).destroy()
    assert time.monotonic() - t0 < 10
    thread.join(15)
    assert not thread.is_alive(), "the exec still hangs after destroy"
    r = outcome["r"]
    assert isinstance(r, errors.SandfleetError | ExecResult), r
    if isinstance(r, ExecResult):
        assert not r.ok
    assert fleet.traces() == []
    with pytest.raises(errors.NotFound):
        fleet.client.get(sb.id).exec("true")


def test_create_and_destroy_repeatedly(fleet: Fleet) -> None:
    """K9: 20 create/exec/destroy rounds in sequence; each leaves nothing, ids never repeat."""
    seen: set[str] = set()
    for i in range(20):
        with fleet.create() as sb:
            assert sb.id not in seen
            seen.add(sb.id)
            assert sb.exec(["echo", str(i)]).stdout == f"{i}\n".encode()
        assert leftovers(fleet.deployment.state_dir, only={sb.id}) == []
    assert fleet.client.list() == []


def test_destroy_is_idempotent_and_final(fleet: Fleet) -> None:
    """K9: destroy twice (and via two handles) is fine; the sandbox is gone for every call after."""
    sb = fleet.create()
    other = fleet.client.get(sb.id)
    sb.destroy()
    sb.destroy()
    other.destroy()
    for call in (
        lambda: fleet.client.get(sb.id),
        lambda: fleet.client.get(sb.id).exec("true"),
    ):
        with pytest.raises(errors.NotFound):
            call()
