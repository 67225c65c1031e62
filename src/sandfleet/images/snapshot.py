"""Snapshots: a sandbox's writable layer packed into a versioned ``diff`` layer.

A sandbox's changes live in the upper directory of its overlay mount, in
overlayfs's own format: changed and new files as they are, a deleted file or
directory as a *whiteout* (a character device 0/0 of the same name), and a
directory that was deleted and made again as an *opaque* directory (xattr
``trusted.overlay.opaque=y``: nothing of the layers below shows through).
That directory, packed as it is into an EROFS file, is a layer that overlayfs
reads the same way when it is stacked as a *lower* layer: a file deleted in
the sandbox stays deleted in sandboxes made from the snapshot, and a replaced
directory shows only its new content. mkfs.erofs (erofs-utils 1.5) keeps
character devices and ``trusted.*`` xattrs (checked by tests/test_snapshot.py
with real mounts), so nothing is translated. Mtimes are kept (build tools go by
them). Two things could make an upper directory mean more than its content:
``redirect_dir`` (a renamed directory refers to its old path below) and
``metacopy`` (a chmod'ed file keeps its data below); the container backend
refuses to snapshot an overlay mounted with either (this kernel's default
is off for both).

The image of a snapshot is the source sandbox's layer stack (the files it was
started from, recorded by the backend: a tag moved since then changes nothing)
with the diff layer on top, kind ``diff``, and an exec config whose ``env`` is
the sandbox's own (image env + the env given at create): a sandbox created
from it runs commands as the source did, with no arguments. Its name is the
caller's, or ``snapshot/<sandbox id>:<n>`` with n = 1, 2, ... per sandbox.

Exclude patterns are globs over absolute paths in the sandbox: ``*`` and ``?``
stay within one path segment, ``[abc]``/``[!abc]`` are character classes, and
a ``**`` segment matches any number of segments (``**/__pycache__`` matches at
every depth; ``/var/cache/**`` everything below /var/cache). A matching
directory is left out with all below it. A path left out is as the source's
layers have it: a whiteout left out means the deleted file is back.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from sandfleet.wire.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from sandfleet.wire.models import (
    SNAPSHOT_EXCLUDE,
    ImageConfig,
    ImageManifest,
    LayerDescriptor,
    NodeCreateRequest,
    SnapshotRequest,
)

from .refs import format_ref, parse_ref
from .store import ImageStore

__all__ = [
    "MAX_EXCLUDE_PATTERNS",
    "Snapshotter",
    "exclude_regexes",
    "snapshot_sandbox",
]

#: At most this many exclude patterns per snapshot.
MAX_EXCLUDE_PATTERNS = 256
_MAX_PATTERN_LEN = 1024
_ERE_SPECIAL = frozenset(".[]()*+?{}|^$\\")
_PATTERN_RULE = (
    "an exclude pattern is an absolute path in the sandbox ('/var/cache/apt/*') or one"
    " starting with '**/' ('**/__pycache__'); '*' and '?' match within one path segment,"
    " '[abc]' / '[!abc]' one character of a class, a '**' segment any number of segments"
)


@runtime_checkable
class Snapshotter(Protocol):
    """A backend that can pack a running box's writable layer (the container backend)."""

    async def snapshot(
        self, sandbox_id: str, meta_file: Path, blob_file: Path, exclude_regex: Sequence[str] = ()
    ) -> list[str] | None:
        """Pack the box's writable layer into a split EROFS layer and return the
        digests of the layers the box was started from, bottom first (None: not recorded)."""
        ...


# --------------------------------------------------------------------------- exclude patterns


def _bad(pattern: str, why: str) -> InvalidArgument:
    return InvalidArgument(f"exclude pattern {pattern!r} is not valid: {why}; {_PATTERN_RULE}")


def _segment_ere(pattern: str, seg: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(seg):
        c = seg[i]
        if c == "*":
            while i + 1 < len(seg) and seg[i + 1] == "*":
                i += 1  # '**' inside a segment is a plain '*'
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            end = seg.find("]", i + 2 if seg[i + 1 : i + 2] in ("!", "^") else i + 1)
            if end < 0:
                raise _bad(pattern, "a '[' has no closing ']'")
            body = seg[i + 1 : end]
            negate = body[:1] in ("!", "^")
            if negate:
                body = body[1:]
            if not body or any(ch in "[\\" for ch in body):
                raise _bad(pattern, f"the class [{seg[i + 1 : end]}] is empty or holds '[' or '\\'")
            out.append(("[^/" if negate else "[") + body + "]")  # never across a '/'
            i = end
        elif c in _ERE_SPECIAL:
            out.append("\\" + c)
        else:
            out.append(c)
        i += 1
    return "".join(out)


def _pattern_ere(pattern: str) -> str:
    if not isinstance(pattern, str) or not pattern:
        raise _bad(str(pattern), "it is empty")
    if len(pattern) > _MAX_PATTERN_LEN:
        raise _bad(pattern[:40] + "...", f"it is longer than {_MAX_PATTERN_LEN} characters")
    if any(c in pattern for c in "\0\n"):
        raise _bad(pattern, "it holds a NUL or a newline")
    if pattern.startswith("/"):
        body = pattern[1:]
    elif pattern.startswith("**/"):
        body = pattern
    else:
        raise _bad(pattern, "it is relative")
    if not body:
        raise _bad(pattern, "it would leave out the whole sandbox")
    segments = body.split("/")
    for seg in segments:
        if seg in ("", ".", ".."):
            raise _bad(pattern, "it has an empty, '.' or '..' segment (or ends with '/')")
    parts = ["^"]
    for i, seg in enumerate(segments):
        last = i == len(segments) - 1
        if seg == "**":
            parts.append(".*" if last else "(.*/)?")
        else:
            parts.append(_segment_ere(pattern, seg) + ("" if last else "/"))
    parts.append("$")
    return "".join(parts)


def exclude_regexes(patterns: Sequence[str] | None) -> list[str]:
    """The ``mkfs.erofs --exclude-regex`` expressions for ``patterns`` (None: the defaults,
    :data:`~sandfleet.wire.models.SNAPSHOT_EXCLUDE`).

    The expressions match paths relative to the layer's root (``tmp/x``), as
    mkfs.erofs sees them. Raises :class:`InvalidArgument` naming a bad pattern.
    """
    if patterns is None:
        patterns = SNAPSHOT_EXCLUDE
    if isinstance(patterns, str):
        raise InvalidArgument(f"exclude must be a list of patterns, not the string {patterns!r}")
    if len(patterns) > MAX_EXCLUDE_PATTERNS:
        raise InvalidArgument(
            f"{len(patterns)} exclude patterns given: at most {MAX_EXCLUDE_PATTERNS}"
        )
    return [_pattern_ere(p) for p in patterns]


# --------------------------------------------------------------------------- naming


def _default_ref(store: ImageStore, sandbox_id: str) -> str:
    name = f"snapshot/{sandbox_id.lower()}"
    taken = [int(m.tag) for m in store.list() if m.name == name and m.tag.isdigit()]
    return format_ref(name, str(max(taken, default=0) + 1))


def _target_ref(store: ImageStore, sandbox_id: str, image: str | None) -> str:
    """The ref the snapshot will be stored as; AlreadyExists before any work if taken."""
    if image is None:
        return _default_ref(store, sandbox_id)
    name, tag = parse_ref(image)
    ref = format_ref(name, tag)
    with contextlib.suppress(NotFound):
        store.resolve(ref)
        raise AlreadyExists(
            f"image {ref} already exists: give snapshot another name or tag (image=...),"
            " or remove it first (`sandfleet image rm`)"
        )
    return ref


# --------------------------------------------------------------------------- the stack below


def _stack_below(
    store: ImageStore, digests: list[str] | None, request: NodeCreateRequest
) -> list[LayerDescriptor]:
    """Descriptors of the layers the sandbox was started from, bottom first."""
    known: dict[str, LayerDescriptor] = {}
    refs = [request.image] + ([request.workspace] if request.workspace else [])
    for ref in refs:
        with contextlib.suppress(NotFound):
            known.update({layer.digest: layer for layer in store.resolve(ref).layers})
    if digests is None:  # a box from before layers were recorded: its refs decide
        from .build import stack_for

        digests = [x.digest for x in stack_for(store, request.image, request.workspace)[0]]
    below = []
    for digest in digests:
        try:
            record = store.layer_record(digest)
        except (NotFound, InvalidArgument):
            raise FailedPrecondition(
                f"layer {digest} of sandbox {request.id} is not in the image store {store.root}"
                " (removed by a gc?): a snapshot needs every layer below it"
            ) from None
        if digest not in known:  # the tag moved since: find the layer's kind elsewhere
            for manifest in store.list():
                known.update({layer.digest: layer for layer in manifest.layers})
        below.append(
            known.get(digest) or LayerDescriptor(digest=digest, size=record.size, kind="base")
        )
    return below


def _commit(
    store: ImageStore,
    ref: str,
    meta_file: Path,
    blob_file: Path,
    below: list[LayerDescriptor],
    config: ImageConfig,
    source: str,
) -> ImageManifest:
    """Add the diff layer and store the image exclusively under ``ref``.

    If the tag was taken meanwhile, the objects stay until a gc: the same
    content may be shared by another image.
    """
    layer = store.add_layer(meta_file, blob_file, "diff", chunk_size=store.chunk_size)
    name, tag = parse_ref(ref)
    manifest = ImageManifest(
        name=name, tag=tag, kind="diff", layers=[*below, layer], config=config, source=source
    )
    store.put(manifest, exclusive=True)
    return manifest


# --------------------------------------------------------------------------- the whole call


async def snapshot_sandbox(
    store: ImageStore,
    backend: object,
    request: NodeCreateRequest,
    config: ImageConfig,
    req: SnapshotRequest,
) -> ImageManifest:
    """Snapshot the running sandbox ``request.id`` into a new image; returns its manifest.

    ``config`` is the exec config the sandbox runs with (its image's); the
    image gets it with the sandbox's own env on top. The box is frozen only
    while its writable layer is packed (see the backend); the layer is hashed
    and stored after it runs again.

    Raises :class:`InvalidArgument` (a bad exclude pattern or image name,
    before any work), :class:`AlreadyExists` (the image name is taken),
    :class:`FailedPrecondition` (the backend of this kind cannot snapshot; the
    sandbox is busy or has no writable layer), :class:`NotFound` (the sandbox
    is gone), :class:`ResourceExhausted` (the store's disk is full).
    Nothing is left behind on failure: no scratch space in the store (a layer
    stored just before its tag was taken by another snapshot stays until a
    gc: content-addressed, it may be shared), and the sandbox runs again (or
    stays paused, if it was).
    """
    regexes = exclude_regexes(req.exclude)
    ref = _target_ref(store, request.id, req.image)
    if not isinstance(backend, Snapshotter):
        raise FailedPrecondition(
            f"sandboxes of kind {request.kind!r} cannot be snapshotted on this node"
        )
    source = f"snapshot of {request.id} ({request.image}"
    source += f" + {request.workspace})" if request.workspace else ")"
    image_config = ImageConfig(env={**config.env, **request.env}, workdir=config.workdir)
    with store.scratch("snapshot-") as scratch:
        meta, blob = scratch / "diff.erofs", scratch / "diff.blob"
        digests = await backend.snapshot(request.id, meta, blob, regexes)
        below = _stack_below(store, digests, request)
        fut = asyncio.get_running_loop().run_in_executor(
            None, _commit, store, ref, meta, blob, below, image_config, source
        )
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            await asyncio.wait({fut})  # the store is consistent before scratch goes
            raise
