"""The ``sandfleet`` command line."""

from __future__ import annotations

import hashlib
import os
import secrets
import signal
import sys
import threading
import time
from pathlib import Path

import click

from sandfleet.config import DEFAULT_URL, default_images_dir, default_state_dir
from sandfleet.wire.errors import FailedPrecondition, InvalidArgument, SandfleetError

__all__ = ["main"]

_state_opt = click.option(
    "--state-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="State directory (env SANDFLEET_STATE_DIR; default /var/lib/sandfleet as root).",
)
_images_opt = click.option(
    "--images-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Image store (env SANDFLEET_IMAGES_DIR; default <state-dir>/images).",
)

_api_token_opt = click.option(
    "--api-token",
    default=None,
    help="Token SDK callers must send (env SANDFLEET_TOKEN); required unless on loopback.",
)

_blob_store_opt = click.option(
    "--blob-store",
    "blob_stores",
    multiple=True,
    envvar="SANDFLEET_BLOB_STORE",
    help="Blob store (file:///dir or http(s)://...) to pull images and fetch layer data"
    " from, after the local image store; repeat for several (env SANDFLEET_BLOB_STORE,"
    " space-separated).",
)
_cp_blob_store_opt = click.option(
    "--blob-store",
    "blob_stores",
    multiple=True,
    envvar="SANDFLEET_BLOB_STORE",
    help="Blob store the nodes pull images from (env SANDFLEET_BLOB_STORE): an image"
    " missing from --images-dir is then left for the node to pull, not refused.",
)


def _check_stores(urls: tuple[str, ...]) -> None:
    """Refuse a malformed blob store URL before anything starts (InvalidArgument)."""
    from sandfleet.blobstore import open_store

    for url in urls:
        open_store(url).close()


_cache_opt = click.option(
    "--chunk-cache-mib",
    default=20 * 1024,
    show_default=True,
    type=click.IntRange(min=16),
    help="Bound of the node's cache of layer data fetched from blob stores, MiB.",
)


def _dirs(state_dir: Path | None, images_dir: Path | None) -> tuple[Path, Path]:
    state = (state_dir or default_state_dir()).resolve()
    return state, (images_dir or default_images_dir(state)).resolve()


def _api_token(token: str | None, host: str) -> str | None:
    """The token SDK callers must send: given, or SANDFLEET_TOKEN; required off loopback."""
    token = token or os.environ.get("SANDFLEET_TOKEN") or None
    if token is None and host not in ("127.0.0.1", "localhost", "::1"):
        raise InvalidArgument(
            f"listening on {host} without an API token would let anyone who reaches the port"
            " run commands: pass --api-token (or set SANDFLEET_TOKEN), or listen on 127.0.0.1"
        )
    return token


def _cluster_token(state_dir: Path, token: str | None) -> str:
    """The node token: given, or SANDFLEET_NODE_TOKEN, or kept in <state-dir>/node-token."""
    token = token or os.environ.get("SANDFLEET_NODE_TOKEN")
    if token:
        return token
    path = state_dir / "node-token"
    if path.exists():
        return path.read_text().strip()
    state_dir.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token)
    return token


@click.group()
@click.version_option(package_name="sandfleet")
def cli() -> None:
    """sandfleet: elastic sandboxes for training and evaluating AI agents with RL."""


@cli.command()
@_state_opt
@_images_opt
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=7070, show_default=True, help="Control plane port.")
@click.option("--node-port", default=7071, show_default=True, help="Node agent port.")
@click.option("--max-sandboxes", default=1000, show_default=True)
@click.option(
    "--node-id",
    default=None,
    help="The node agent's id (default: local-<6 hex of the state dir>, so that two"
    " deployments on one host never share one).",
)
@click.option("--keep/--destroy-on-exit", default=False, help="Keep sandboxes when stopping.")
@_api_token_opt
@_blob_store_opt
@_cache_opt
def up(
    state_dir: Path | None,
    images_dir: Path | None,
    host: str,
    port: int,
    node_port: int,
    max_sandboxes: int,
    node_id: str | None,
    keep: bool,
    api_token: str | None,
    blob_stores: tuple[str, ...],
    chunk_cache_mib: int,
) -> None:
    """Run a control plane and one node agent together on embedded defaults.

    The node agent runs as a child process, so the two event loops use two
    cores under burst load. A node agent that dies is started again (it adopts
    its sandboxes); if this process dies, the node agent stops keeping its
    sandboxes, for the next `up` on this state dir to adopt.
    """
    from sandfleet.cli.serve import check_ports_free, lock_dir, run_servers, spawn_child
    from sandfleet.controlplane.app import create_app

    state, images = _dirs(state_dir, images_dir)
    _check_stores(blob_stores)
    lock_dir(state, "sandfleet up")
    if node_id is None:
        node_id = "local-" + hashlib.sha256(str(state.resolve()).encode()).hexdigest()[:6]
    check_ports_free(host, [port, node_port])
    token = _cluster_token(state, None)
    cp_url = f"http://{host}:{port}"
    cp = create_app(
        db_url=f"sqlite:///{state / 'controlplane.db'}",
        images_dir=images,
        node_token=token,
        api_token=_api_token(api_token, host),
        pulls_images=bool(blob_stores),
    )
    node_args = [
        "node", "--state-dir", str(state), "--images-dir", str(images), "--node-id", node_id,
        "--control-plane", cp_url, "--host", host, "--port", str(node_port),
        "--max-sandboxes", str(max_sandboxes), "--keep" if keep else "--destroy-on-exit",
        "--chunk-cache-mib", str(chunk_cache_mib),
        *(a for url in blob_stores for a in ("--blob-store", url)),
    ]  # fmt: skip
    click.echo(f"sandfleet up: control plane {cp_url}, node agent :{node_port}, state {state}")
    env = {"SANDFLEET_NODE_TOKEN": token}
    node = [spawn_child(node_args, env)]
    stopping = threading.Event()

    def supervise_node() -> None:
        # A node agent that dies is started again: it adopts the sandboxes that
        # kept running. One that keeps dying at once stops `up`.
        quick_deaths = 0
        while True:
            started = time.monotonic()
            code = node[0].wait()
            if stopping.is_set():
                return
            quick_deaths = quick_deaths + 1 if time.monotonic() - started < 10 else 0
            if quick_deaths >= 3:
                click.echo(f"sandfleet up: the node agent keeps exiting ({code}); stopping")
                os.kill(os.getpid(), signal.SIGTERM)
                return
            click.echo(f"sandfleet up: the node agent exited ({code}); starting it again")
            node[0] = spawn_child(node_args, env)

    threading.Thread(target=supervise_node, daemon=True).start()
    try:
        run_servers([(cp, host, port)])
    finally:
        stopping.set()
        node[0].terminate()
        code = node[0].wait()
    if code not in (0, -signal.SIGTERM):
        raise FailedPrecondition(f"the node agent exited with status {code}; see its log above")


@cli.command()
@_state_opt
@_images_opt
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=7070, show_default=True)
@click.option(
    "--db", default=None, help="SQLAlchemy URL of the store (default SQLite in state dir)."
)
@click.option("--token", default=None, help="Token nodes must present (env SANDFLEET_NODE_TOKEN).")
@_api_token_opt
@_cp_blob_store_opt
def controlplane(
    state_dir: Path | None,
    images_dir: Path | None,
    host: str,
    port: int,
    db: str | None,
    token: str | None,
    api_token: str | None,
    blob_stores: tuple[str, ...],
) -> None:
    """Run the control plane alone."""
    from sandfleet.cli.serve import check_ports_free, run_servers
    from sandfleet.controlplane.app import create_app

    state, images = _dirs(state_dir, images_dir)
    state.mkdir(parents=True, exist_ok=True)
    check_ports_free(host, [port])
    app = create_app(
        db_url=db or f"sqlite:///{state / 'controlplane.db'}",
        images_dir=images,
        node_token=_cluster_token(state, token),
        api_token=_api_token(api_token, host),
        pulls_images=bool(blob_stores),  # nodes pull: an image missing here may be there
    )
    run_servers([(app, host, port)])


@cli.command()
@_state_opt
@_images_opt
@click.option("--node-id", required=True, help="This node's id: a-z, 0-9, '-'.")
@click.option("--control-plane", default=DEFAULT_URL, show_default=True)
@click.option("--token", default=None, help="Node token (env SANDFLEET_NODE_TOKEN).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=7071, show_default=True)
@click.option("--advertise", default=None, help="URL the control plane reaches this node at.")
@click.option("--max-sandboxes", default=1000, show_default=True)
@click.option("--memory-mb", default=None, type=int, help="Memory to admit (MiB).")
@click.option(
    "--keep/--destroy-on-exit",
    default=True,
    help="Keep sandboxes running when stopping (the next node agent adopts them).",
)
@_blob_store_opt
@_cache_opt
def node(
    state_dir: Path | None,
    images_dir: Path | None,
    node_id: str,
    control_plane: str,
    token: str | None,
    host: str,
    port: int,
    advertise: str | None,
    max_sandboxes: int,
    memory_mb: int | None,
    keep: bool,
    blob_stores: tuple[str, ...],
    chunk_cache_mib: int,
) -> None:
    """Run a node agent that registers with a control plane."""
    from sandfleet.cli.serve import build_node_app, check_ports_free, run_servers

    _check_stores(blob_stores)
    state, images = _dirs(state_dir, images_dir)
    check_ports_free(host, [port])
    app = build_node_app(
        node_id=node_id,
        state_dir=state,
        images_dir=images,
        token=_cluster_token(state, token),
        control_plane=control_plane,
        advertise=advertise or f"http://{host}:{port}",
        max_sandboxes=max_sandboxes,
        memory_mb=memory_mb,
        destroy_on_exit=not keep,
        blob_stores=list(blob_stores),
        cache_bytes=chunk_cache_mib << 20,
    )
    run_servers([(app, host, port)])


def main() -> None:
    """Entry point: sandfleet errors print their message, not a traceback."""
    from sandfleet.cli import demo as _demo  # noqa: F401 - registers `demo`
    from sandfleet.cli import images as _images  # noqa: F401 - registers `image`
    from sandfleet.cli import log as _log  # noqa: F401 - registers `log`
    from sandfleet.cli import pools as _pools  # noqa: F401 - registers `pools`

    try:
        cli(standalone_mode=True)
    except SandfleetError as exc:
        click.echo(f"error ({exc.code}): {exc.message}", err=True)
        sys.exit(2)


@cli.command()
def doctor() -> None:
    """Report the kernel features and tools this host has, and the kinds they allow."""
    from rich.console import Console
    from rich.table import Table

    from sandfleet.node.doctor import kinds_offered, run_checks

    checks = run_checks()
    table = Table("check", "ok", "detail")
    for c in checks:
        table.add_row(c.name, "[green]yes[/]" if c.ok else "[red]no[/]", c.detail)
    kinds = Table("kind", "on this host")
    for kind, meaning in kinds_offered(checks).items():
        kinds.add_row(kind, meaning)
    console = Console()
    console.print(table)
    console.print(kinds)
