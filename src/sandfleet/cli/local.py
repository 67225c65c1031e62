"""A local all-in-one deployment (``sandfleet up``) run as a child process.

Used by the demo when no ``--url`` is given, and by tests and benchmarks, so
they all talk to real servers over HTTP.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from sandfleet.cli.serve import free_port
from sandfleet.wire.errors import Unavailable

__all__ = ["LocalDeployment"]


class LocalDeployment:
    """``sandfleet up`` on free ports with its state under ``state_dir``.

    Use as a context manager; ``url`` is the control plane's base URL. Exiting
    stops the servers (SIGTERM), which destroys the sandboxes they host.
    Raises Unavailable when the deployment does not become ready within
    ``ready_timeout_s`` seconds (its log is in the message).
    """

    def __init__(
        self,
        state_dir: Path,
        images_dir: Path | None = None,
        ready_timeout_s: float = 60.0,
        *,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.state_dir = state_dir
        #: More environment for ``sandfleet up`` (e.g. ``SANDFLEET_VM_TEMPLATES``).
        self.env = dict(env or {})
        #: More ``sandfleet up`` options, e.g. ``["--blob-store", url]``.
        self.extra_args = list(extra_args)
        self.images_dir = images_dir or state_dir / "images"
        self.port = free_port()
        self.node_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # A node id of its own, so leak checks tell its sandboxes from any others on the host.
        self.node_id = f"local-{secrets.token_hex(3)}"
        self.log_path = state_dir / "up.log"
        self._ready_timeout_s = ready_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None

    def node_get(self, path: str) -> Any:
        """GET ``path`` (e.g. ``/v1/layers/stats``) from the node agent with the node
        token; returns the decoded JSON. Raises ``httpx.HTTPError``."""
        token = (self.state_dir / "node-token").read_text().strip()
        r = httpx.get(
            f"http://127.0.0.1:{self.node_port}{path}",
            headers={"authorization": f"Bearer {token}"},
            timeout=10,
        )
        r.raise_for_status()
        return r.json()

    def start(self) -> LocalDeployment:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        cmd = [
            sys.executable,
            "-m",
            "sandfleet.cli",
            "up",
            "--state-dir",
            str(self.state_dir),
            "--images-dir",
            str(self.images_dir),
            "--port",
            str(self.port),
            "--node-port",
            str(self.node_port),
            "--node-id",
            self.node_id,
            *self.extra_args,
        ]
        env = {
            **os.environ,
            "SANDFLEET_LOG_LEVEL": os.environ.get("SANDFLEET_LOG_LEVEL", "warning"),
            **self.env,
        }
        try:
            self._proc = subprocess.Popen(
                cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env
            )
        finally:
            log.close()
        t0 = time.time()
        deadline = time.monotonic() + self._ready_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            try:
                nodes = httpx.get(f"{self.url}/v1/nodes", timeout=1.0).json()["nodes"]
                # Its own node, registered by this run (a record may survive a restart).
                if any(
                    n["node_id"] == self.node_id and n["healthy"] and n["last_heartbeat"] >= t0
                    for n in nodes
                ):
                    return self
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            time.sleep(0.1)
        self.stop()
        raise Unavailable(f"`sandfleet up` did not become ready; its log:\n{self.log()[-3000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM and wait; SIGKILL if it does not stop within ``timeout_s`` seconds."""
        if self._proc is None or self._proc.poll() is not None:
            return
        self._proc.send_signal(signal.SIGTERM)
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def kill(self) -> None:
        """SIGKILL the deployment, as a crash would (sandboxes keep running)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def __enter__(self) -> LocalDeployment:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
