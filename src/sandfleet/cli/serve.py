"""Running the servers: control plane, node agent, or both (``up``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import uvicorn
import uvloop
from fastapi import FastAPI

from sandfleet.wire.models import NodeCapacity, NodeRegistration

__all__ = ["build_node_app", "free_port", "run_servers", "spawn_child"]


class _Server(uvicorn.Server):
    """A uvicorn server whose signals are handled by :func:`run_servers` for all at once."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _config(app: object, host: str, port: int) -> uvicorn.Config:
    return uvicorn.Config(
        app,  # type: ignore[arg-type]
        host=host,
        port=port,
        log_level=os.environ.get("SANDFLEET_LOG_LEVEL", "warning"),
        access_log=False,
        timeout_graceful_shutdown=10,
        # Longer than any client's keep-alive (httpx: 5 s), so a client never sends on a
        # connection the server is closing (a ReadError under bursts otherwise).
        timeout_keep_alive=75,
        lifespan="on",
    )


#: Seconds a node agent waits for the previous one on its state dir to let go.
NODE_LOCK_WAIT_S = 30.0
#: The signal that stopped :func:`run_servers`, once one has. SIGHUP is what a
#: child of ``sandfleet up`` gets when ``up`` itself died (see :func:`spawn_child`).
stopped_by: int | None = None


def run_servers(apps: list[tuple[object, str, int]]) -> None:
    """Serve each ``(app, host, port)`` in one event loop until SIGINT, SIGTERM or SIGHUP."""
    servers = [_Server(_config(app, host, port)) for app, host, port in apps]

    async def main() -> None:
        loop = asyncio.get_running_loop()

        def stop_all(sig: int) -> None:
            global stopped_by
            stopped_by = sig
            for s in servers:
                s.should_exit = True
                # Orphaned: whoever called is gone; stop at once (what runs is killed
                # with us, and the next start adopts and accounts for it).
                s.force_exit = sig == signal.SIGHUP

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(sig, stop_all, sig)
        await asyncio.gather(*(s.serve() for s in servers))

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per heartbeat
    # uvloop: about a third less CPU per request than asyncio's own loop, which
    # matters at thousands of fncall calls per second.
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())


def build_node_app(
    *,
    node_id: str,
    state_dir: Path,
    images_dir: Path,
    token: str | None,
    control_plane: str | None,
    advertise: str,
    max_sandboxes: int,
    memory_mb: int | None,
    destroy_on_exit: bool,
    blob_stores: list[str] | None = None,
    cache_bytes: int = 20 << 30,
) -> FastAPI:
    """A node agent app with the container backend, ready for :func:`run_servers`.

    ``blob_stores``: URLs to pull images and fetch layer data from;
    ``cache_bytes`` bounds the node's chunk cache.

    Raises FailedPrecondition when another node agent holds this node's state dir.
    """
    from sandfleet.backends.registry import load_backends
    from sandfleet.controlplane.ids import validate_node_id
    from sandfleet.node.app import create_node_app
    from sandfleet.node.service import NodeService

    validate_node_id(node_id)
    _become_subreaper()
    node_dir = state_dir / "nodes" / node_id
    # A node agent orphaned by a dead `sandfleet up` may still be stopping: wait for it.
    lock_fd = lock_dir(node_dir, f"node agent {node_id}", wait_s=NODE_LOCK_WAIT_S)
    backends = load_backends(node_dir)
    host_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024)
    capacity = NodeCapacity(
        max_sandboxes=max_sandboxes,
        cpu=float(os.cpu_count() or 1),
        # Memory limits are ceilings, not use: allow 4x overcommit by default.
        memory_mb=memory_mb or host_mb * 4,
    )
    service = NodeService(
        node_id,
        node_dir,
        images_dir,
        backends,
        capacity,
        blob_stores=blob_stores or [],
        cache_bytes=cache_bytes,
    )
    registration = NodeRegistration(
        node_id=node_id,
        address=advertise,
        kinds=sorted([*backends, *(["fncall"] if service.fncall else [])]),
        capacity=capacity,
        capabilities={k: b.capabilities() for k, b in backends.items()},
    )
    app = create_node_app(
        service,
        token=token,
        control_plane=control_plane,
        registration=registration,
        destroy_on_exit=destroy_on_exit,
    )
    app.state.lock_fd = lock_fd  # held, and so locked, for the process's life
    return app


def lock_dir(directory: Path, what: str, wait_s: float = 0.0) -> int:
    """Lock ``directory`` for this process; FailedPrecondition if another holds it
    for longer than ``wait_s`` seconds (one that is stopping lets go).

    The lock (flock on ``directory/lock``, which names the holder's pid) dies
    with the process, so a crash never leaves a stale lock.
    """
    import fcntl

    from sandfleet.wire.errors import FailedPrecondition

    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise FailedPrecondition(
                f"{directory} is in use by another {what} (pid {holder}); stop it, or give"
                " this one another --state-dir or --node-id"
            ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def check_ports_free(host: str, ports: list[int]) -> None:
    """FailedPrecondition naming the first of ``ports`` already taken on ``host``."""
    from sandfleet.wire.errors import FailedPrecondition

    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as exc:
                raise FailedPrecondition(
                    f"cannot listen on {host}:{port} ({exc.strerror}): another server uses it;"
                    " stop it or pass another port"
                ) from None


def _become_subreaper() -> None:
    """Adopt orphaned box init processes so destroy reaps them at once, not the host's init."""
    import ctypes

    pr_set_child_subreaper = 36
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_child_subreaper, 1, 0, 0, 0)


def spawn_child(args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Run ``sandfleet ARGS`` as a child that gets SIGHUP if this process dies.

    SIGHUP, not SIGTERM: a child can then tell its parent's death (keep state
    for the next start to adopt) from being asked to stop (SIGTERM).
    """

    def die_with_parent() -> None:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGHUP, 0, 0, 0)

    return subprocess.Popen(
        [sys.executable, "-m", "sandfleet.cli", *args],
        env={**os.environ, **env},
        stdin=subprocess.DEVNULL,
        preexec_fn=die_with_parent,
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on ``host`` (for tests and ``up --port 0``)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
