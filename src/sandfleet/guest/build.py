"""Builds the static ``sandfleet-agent`` binary from ``agent.c``.

Used three ways: by ``setup.py`` during ``pip install`` (this file is loaded by
path there, so it imports nothing from sandfleet at module level), by
``python -m sandfleet.guest.build``, and at run time by :func:`agent_binary`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["AGENT_SOURCE", "PACKAGED_BINARY", "agent_binary", "compile_agent", "find_compiler"]

AGENT_SOURCE = Path(__file__).with_name("agent.c")
PACKAGED_BINARY = Path(__file__).with_name("_bin") / "sandfleet-agent"
_FLAGS = ["-static", "-Os", "-s", "-Wall", "-Wextra"]


def find_compiler() -> list[str] | None:
    """musl-gcc (smallest static binary) if present, else cc/gcc; None if neither."""
    for name in ("musl-gcc", "cc", "gcc"):
        path = shutil.which(name)
        if path:
            return [path]
    return None


def _no_compiler() -> Exception:
    msg = (
        "no C compiler found to build the in-sandbox agent: install musl-tools "
        "(preferred, apt-get install musl-tools) or gcc"
    )
    try:
        from sandfleet.wire.errors import FailedPrecondition
    except ImportError:  # loaded by setup.py before sandfleet is importable
        return RuntimeError(msg)
    return FailedPrecondition(msg)


def compile_agent(output: Path, source: Path = AGENT_SOURCE) -> Path:
    """Compile ``source`` statically into ``output`` (atomically) and return it.

    Raises FailedPrecondition without a compiler, RuntimeError if compiling fails.
    """
    cc = find_compiler()
    if cc is None:
        raise _no_compiler()
    output.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".sandfleet-agent-", dir=output.parent)
    os.close(fd)
    try:
        proc = subprocess.run(
            [*cc, *_FLAGS, "-o", tmp, str(source)], capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            raise RuntimeError(f"compiling {source} with {cc[0]} failed:\n{proc.stderr.strip()}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, output)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return output


def _cache_dir() -> Path:
    env = os.environ.get("SANDFLEET_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "sandfleet"


def agent_binary() -> Path:
    """Path of a ``sandfleet-agent`` binary that matches ``agent.c``.

    The packaged binary when it exists and is not older than the source; else
    one compiled into ``$SANDFLEET_CACHE_DIR`` (default ``~/.cache/sandfleet``),
    keyed by the source's sha256, compiling it on first use.
    Raises FailedPrecondition when a build is needed and no compiler exists.
    """
    have_src = AGENT_SOURCE.exists()
    if PACKAGED_BINARY.exists() and (
        not have_src or PACKAGED_BINARY.stat().st_mtime >= AGENT_SOURCE.stat().st_mtime
    ):
        return PACKAGED_BINARY
    if not have_src:
        from sandfleet.wire.errors import FailedPrecondition

        raise FailedPrecondition(
            f"neither the agent binary {PACKAGED_BINARY} nor its source {AGENT_SOURCE} exists: "
            "reinstall sandfleet"
        )
    digest = hashlib.sha256(AGENT_SOURCE.read_bytes()).hexdigest()[:16]
    cached = _cache_dir() / f"sandfleet-agent-{digest}"
    if cached.exists():
        return cached
    return compile_agent(cached)


def main() -> int:
    """``python -m sandfleet.guest.build [OUTPUT]``: build the packaged binary."""
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else PACKAGED_BINARY
    try:
        compile_agent(out)
    except Exception as exc:  # report, do not dump a traceback on a missing compiler
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"built {out} ({out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
