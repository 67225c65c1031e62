"""The on-demand daemon: ``python -m sandfleet.ondemand --mount DIR --store ROOT ...``.

Mounts the layer file system (:mod:`.fs`) at ``--mount`` in the foreground,
serves the control socket (:mod:`.control`) and runs until SIGTERM, SIGINT
or SIGHUP (libfuse unmounts, the daemon exits 0) or until the mount is
unmounted from outside. Exit status 2: the mount failed (message on stderr).
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import stat
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sandfleet.blobstore import DEFAULT_TIMEOUT_S, open_store
from sandfleet.wire.errors import SandfleetError

from .cache import ChunkCache
from .control import ControlServer
from .fetcher import DEFAULT_DEADLINE_S, DEFAULT_READAHEAD, Fetcher

EXIT_MOUNT_FAILED = 2


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m sandfleet.ondemand",
        description="Serve layers' data blobs as files, fetching chunks on demand.",
    )
    p.add_argument("--mount", required=True, type=Path, help="directory to mount on")
    p.add_argument("--store", required=True, type=Path, help="local image store root")
    p.add_argument("--cache", required=True, type=Path, help="chunk cache directory")
    p.add_argument("--cache-bytes", required=True, type=int, help="chunk cache size, bytes")
    p.add_argument(
        "--remote", action="append", default=[], help="blob store URL, tried in order (repeat)"
    )
    p.add_argument("--socket", required=True, type=Path, help="control socket path")
    p.add_argument("--readahead", type=int, default=DEFAULT_READAHEAD, help="chunks fetched ahead")
    p.add_argument(
        "--deadline-s",
        type=float,
        default=DEFAULT_DEADLINE_S,
        help="seconds a chunk may take from the remotes, retries included",
    )
    p.add_argument("--debug", action="store_true", help="libfuse debug output")
    return p.parse_args(argv)


def _fail(msg: str) -> int:
    print(f"sandfleet-ondemand: {msg}", file=sys.stderr, flush=True)
    return EXIT_MOUNT_FAILED


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not os.path.exists("/dev/fuse"):
        return _fail("FUSE not available: /dev/fuse is missing (modprobe fuse; install fuse3)")
    try:
        from . import fs
    except (OSError, ImportError) as e:  # mfusepy could not load libfuse
        return _fail(f"FUSE not available: {e} (install fuse3 / libfuse3-3)")
    try:
        if not stat.S_ISDIR(os.stat(args.mount).st_mode):
            return _fail(f"mount point {args.mount} is not a directory")
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            return _fail(f"a dead FUSE mount is at {args.mount}: umount -l {args.mount} first")
        if e.errno != errno.ENOENT:
            return _fail(f"mount point {args.mount}: {e}")
        args.mount.mkdir(parents=True, exist_ok=True)
    try:
        cache = ChunkCache(args.cache, args.cache_bytes)
        timeout = min(DEFAULT_TIMEOUT_S, args.deadline_s)
        remotes = [open_store(url, timeout_s=timeout) for url in args.remote]
        fetcher = Fetcher(
            args.store, cache, remotes, readahead=args.readahead, deadline_s=args.deadline_s
        )
    except (SandfleetError, OSError) as e:
        return _fail(str(e))
    started = time.time()
    state: dict[str, Any] = {"mounted": False}

    def status() -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "mount": str(args.mount),
            "mounted": state["mounted"],
            "started": started,
            "remotes": list(args.remote),
            "readahead": args.readahead,
            "deadline_s": args.deadline_s,
        }

    mount_point = os.path.realpath(args.mount)  # now: later, resolving it would ask the mount

    def after_init() -> None:
        # The kernel sets the read-ahead when it gets libfuse's answer to INIT, after
        # on_init returns; a stat of the mount waits for that answer.
        try:
            os.stat(mount_point)
            fs.tune_read_ahead(mount_point)
        except (OSError, LookupError) as e:
            logging.warning("kernel read-ahead of %s left as is: %s", mount_point, e)
        state["mounted"] = True
        logging.info("mounted at %s", args.mount)

    def on_init() -> None:
        threading.Thread(target=after_init, name="after-init", daemon=True).start()

    ops = fs.LayerFS(args.store, fetcher, on_init=on_init)
    try:
        control = ControlServer(args.socket, fetcher, ops.layer, status)
    except OSError as e:
        fetcher.close()
        return _fail(f"control socket {args.socket}: {e}")
    control.start()
    try:
        fs.mount(ops, args.mount, debug=args.debug)
    except RuntimeError as e:
        if not state["mounted"]:
            return _fail(
                f"cannot mount the FUSE file system at {args.mount} (libfuse status {e});"
                " FUSE not available? install fuse3, check /dev/fuse and that we run as root"
            )
        # libfuse 3 ends its loop with status 8 when a signal stopped it: a normal stop.
        logging.info("libfuse loop ended with status %s", e)
    finally:
        state["mounted"] = False
        control.close()
        fetcher.close()
    logging.info("unmounted from %s; exiting", args.mount)
    return 0


if __name__ == "__main__":
    sys.exit(main())
