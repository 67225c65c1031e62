"""A real nginx for tests: Debian's binary serving a directory on a free loopback port."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

NGINX = "/usr/sbin/nginx"

_CONF = """\
daemon off;
master_process on;
worker_processes 2;
{user}
error_log {prefix}/error.log info;
pid {prefix}/nginx.pid;
events {{ worker_connections 256; }}
http {{
    access_log off;
    default_type application/octet-stream;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    server {{
        listen 127.0.0.1:{port};
        root {root};
        location / {{
            autoindex on;
            autoindex_format json;
{dav}
        }}
    }}
}}
"""

_DAV = """\
            dav_methods PUT DELETE;
            create_full_put_path on;
            dav_access user:rw group:r all:r;
            client_max_body_size 0;"""


def free_port() -> int:
    """A TCP port nothing listens on at 127.0.0.1 (now; a race is possible, see callers)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def nginx_server(root: Path, *, dav: bool = True, timeout_s: float = 10.0) -> Iterator[str]:
    """Serve ``root`` with nginx and yield its URL (``http://127.0.0.1:<port>``).

    With ``dav`` it takes PUT and DELETE (a writable blob store); without, it is
    read-only. nginx is stopped, and waited for, on exit.
    """
    if not os.access(NGINX, os.X_OK):
        raise RuntimeError(f"{NGINX} is missing: run scripts/setup (apt install nginx-light)")
    with tempfile.TemporaryDirectory(prefix="sandfleet-nginx-") as prefix:
        for attempt in range(5):  # another process may take the free port first
            port = free_port()
            conf = Path(prefix) / "nginx.conf"
            conf.write_text(
                _CONF.format(
                    # as root, workers would drop to `nobody`, who cannot read pytest's tmp dirs
                    user="user root;" if os.geteuid() == 0 else "",
                    prefix=prefix,
                    port=port,
                    root=Path(root).resolve(),
                    dav=_DAV if dav else "",
                )
            )
            proc = subprocess.Popen(
                [NGINX, "-c", str(conf), "-p", prefix, "-e", f"{prefix}/error.log"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            try:
                if _wait_listening(proc, port, timeout_s):
                    yield f"http://127.0.0.1:{port}"
                    return
            finally:
                _stop(proc)
            log = (Path(prefix) / "error.log").read_text(errors="replace")
            if "Address already in use" not in log or attempt == 4:
                raise RuntimeError(f"nginx did not start on port {port}:\n{log[-2000:]}")


def _wait_listening(proc: subprocess.Popen[bytes], port: int, timeout_s: float) -> bool:
    """Whether nginx accepts connections on ``port`` before it exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return True
        time.sleep(0.02)
    return False


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Fast shutdown (TERM: the master exits after its workers), else KILL its process group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the master is alive, so the group is ours
            proc.wait()
