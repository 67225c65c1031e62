"""Build a ``workspace`` layer: a project's tree under /workspace.

Sources, told apart by :func:`classify_source`:

* a local sdist or archive (``.tar.gz``, ``.tgz``, ``.tar.bz2``, ``.tar.xz``, ``.tar``, ``.zip``),
* a git repository: a local path or a URL (``https://``, ``ssh://``, ``git://``,
  ``file://``, ``git+<url>``, ``user@host:path``), optionally ``@rev``,
* a local directory that is not a git repository (copied as it is),
* a PyPI requirement such as ``more-itertools==10.5.0`` (its sdist is fetched
  with ``pip download --no-binary :all:``).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sandfleet.wire.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from sandfleet.wire.models import ImageConfig, ImageManifest

from .build import Log, commit_layers, run_tool, stderr_log
from .extract import extract_archive, is_archive
from .refs import parse_ref
from .store import ImageStore

__all__ = ["WORKDIR", "WorkspaceSource", "build_workspace", "classify_source"]

WORKDIR = "/workspace"

_REQ_RE = re.compile(
    r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?(?:\[[A-Za-z0-9._,\s-]*\])?"
    r"(?:\s*(?:===|==|~=|!=|<=|>=|<|>)\s*[A-Za-z0-9.*+!_-]+"
    r"(?:\s*,\s*(?:===|==|~=|!=|<=|>=|<|>)\s*[A-Za-z0-9.*+!_-]+)*)?"
)
_URL_RE = re.compile(r"(?:git\+)?[a-z][a-z0-9+.-]*://")
_SCP_RE = re.compile(r"[A-Za-z0-9._-]+@[A-Za-z0-9.-]+:")
_FORMS = (
    "a local sdist (.tar.gz/.zip), a git repository (local path or URL, optionally '@rev'), "
    "a local directory, or a PyPI requirement like 'more-itertools==10.5.0'"
)


@dataclass(frozen=True)
class WorkspaceSource:
    """A classified workspace source: ``kind`` and where to get it."""

    kind: Literal["archive", "git", "dir", "pypi"]
    location: str
    rev: str | None = None


def classify_source(source: str) -> WorkspaceSource:
    """Decide what ``source`` is (see the module docstring); no network access.

    Raises :class:`NotFound` for a local path that does not exist and
    :class:`InvalidArgument` for anything unrecognised.
    """
    source = source.strip()
    if not source:
        raise InvalidArgument(f"empty workspace source; give {_FORMS}")
    path = Path(source).expanduser()
    if path.exists():
        if path.is_file():
            if not is_archive(path):
                raise InvalidArgument(f"{source} is not a supported archive; give {_FORMS}")
            return WorkspaceSource("archive", str(path.resolve()))
        return WorkspaceSource("git" if _is_git(path) else "dir", str(path.resolve()))
    base, rev = _split_rev(source)
    if rev is not None and Path(base).expanduser().is_dir():
        return WorkspaceSource("git", str(Path(base).expanduser().resolve()), rev)
    if _URL_RE.match(source) or _SCP_RE.match(source) or base.endswith(".git"):
        url = base[4:] if base.startswith("git+") else base
        return WorkspaceSource("git", url, rev)
    if is_archive(path) or "/" in source or source.startswith("."):
        raise NotFound(f"workspace source {source} does not exist")
    if _REQ_RE.fullmatch(source):
        return WorkspaceSource("pypi", source)
    raise InvalidArgument(f"cannot tell what workspace source {source!r} is; give {_FORMS}")


def build_workspace(
    store: ImageStore, ref: str, source: str, *, keep_git: bool = True, log: Log = stderr_log
) -> ImageManifest:
    """Build a one-layer ``workspace`` image: the project's top directory at /workspace.

    The archive's single top directory (``pkg-1.0/``) is stripped; a git
    repository is cloned at ``rev`` (default: its HEAD; uncommitted changes
    are not included), with its ``.git`` unless ``keep_git=False``. Every
    file is owned by root; config workdir is ``/workspace``. Returns the
    stored manifest.

    Raises :class:`InvalidArgument` for a bad ref, an unrecognised source or
    an unsafe archive, :class:`NotFound` for a missing local source or an
    unknown PyPI project, :class:`Unavailable` when pip or git cannot reach
    their server, and :class:`FailedPrecondition` when a git step fails.
    """
    parse_ref(ref)
    src = classify_source(source)
    with store.scratch("workspace-") as scratch:
        tree = scratch / "tree"
        tree.mkdir(mode=0o755)
        dest = tree / WORKDIR.lstrip("/")
        provenance = f"{src.kind}:{src.location}"
        if src.kind == "pypi":
            archive = _pip_download(src.location, scratch / "download", log)
            provenance += f" ({archive.name})"
            _unpack(archive, scratch / "unpacked", dest)
        elif src.kind == "archive":
            _unpack(Path(src.location), scratch / "unpacked", dest)
        elif src.kind == "git":
            commit = _git_clone(src, dest, log)
            provenance += f"@{commit}"
            if not keep_git:
                shutil.rmtree(dest / ".git")
        else:
            log(f"copying {src.location}")
            shutil.copytree(src.location, dest, symlinks=True)
        dest.chmod(0o755)
        return commit_layers(
            store,
            ref,
            [tree],
            scratch,
            kind="workspace",
            config=ImageConfig(workdir=WORKDIR),
            source=provenance,
            all_root=True,
            log=log,
        )


def _is_git(path: Path) -> bool:
    return (path / ".git").exists() or ((path / "HEAD").is_file() and (path / "objects").is_dir())


def _split_rev(source: str) -> tuple[str, str | None]:
    """``'repo@rev'`` -> ``('repo', 'rev')``; an ``@`` of ``user@host`` is not a rev."""
    at = source.rfind("@")
    if at <= 0:
        return source, None
    head, rev = source[:at], source[at + 1 :]
    if not rev or ":" in rev:
        return source, None
    m = _URL_RE.match(head)
    if m and "/" not in head[m.end() :]:  # ssh://user@host/... : '@' is inside the authority
        return source, None
    return head, rev


def _unpack(archive: Path, work: Path, dest: Path) -> None:
    work.mkdir()
    extract_archive(archive, work)
    entries = list(work.iterdir())
    top = entries[0] if len(entries) == 1 else None
    if top is not None and top.is_dir() and not top.is_symlink():
        top.rename(dest)
    else:
        work.rename(dest)


def _pip_download(spec: str, work: Path, log: Log) -> Path:
    work.mkdir()
    log(f"pip download {spec} (sdist)")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary",
        ":all:",
        "--disable-pip-version-check",
        "-d",
        str(work),
        spec,
    ]
    try:
        run_tool(
            cmd,
            f"pip download {spec}",
            Unavailable,
            hint="check the requirement and that the package index is reachable",
        )
    except Unavailable as exc:
        if "No matching distribution" in exc.message or "Could not find a version" in exc.message:
            raise NotFound(f"no sdist on the package index for {spec!r}: {exc.message}") from None
        raise
    files = [p for p in work.iterdir() if is_archive(p)]
    if len(files) != 1:
        raise FailedPrecondition(f"pip download {spec} gave {len(files)} archives, expected 1")
    return files[0]


def _git_clone(src: WorkspaceSource, dest: Path, log: Log) -> str:
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0", "GIT_ASKPASS": "true"}
    local = Path(src.location).is_dir()
    cmd = ["git", "-c", "advice.detachedHead=false", "clone", "--quiet"]
    if src.rev is not None:
        cmd.append("--no-checkout")
    elif not local:
        cmd += ["--depth", "1"]
    log(f"git clone {src.location}" + (f" at {src.rev}" if src.rev else ""))
    err: type[FailedPrecondition] | type[Unavailable] = FailedPrecondition if local else Unavailable
    run_tool([*cmd, "--", src.location, str(dest)], f"git clone {src.location}", err, env=env)
    if src.rev is not None:
        run_tool(
            ["git", "-c", "advice.detachedHead=false", "checkout", "--quiet", src.rev, "--"],
            f"git checkout {src.rev}",
            InvalidArgument,
            hint=f"is {src.rev!r} a branch, tag or commit of {src.location}?",
            env=env,
            cwd=dest,
        )
    return run_tool(
        ["git", "rev-parse", "HEAD"], "git rev-parse", FailedPrecondition, env=env, cwd=dest
    ).strip()
