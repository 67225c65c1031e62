"""Image references: ``name[:tag]``, validated before anything touches disk."""

from __future__ import annotations

import re

from sandfleet.wire.errors import InvalidArgument

__all__ = ["DEFAULT_TAG", "format_ref", "parse_ref", "validate_name", "validate_tag"]

DEFAULT_TAG = "latest"
MAX_LEN = 128

_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._/-]*")
_TAG_RE = re.compile(r"[A-Za-z0-9_.-]+")

_NAME_RULE = (
    "an image name is 1-128 characters of lowercase letters, digits and '._/-', starts with a "
    "letter or digit, and has no empty, '.' or '..' path segments (e.g. 'debian/python3')"
)
_TAG_RULE = "a tag is 1-128 characters of letters, digits and '_.-' (e.g. 'latest', 'v1.2')"


def validate_name(name: str) -> str:
    """Return ``name`` unchanged when it is a valid image name.

    Raises :class:`InvalidArgument` saying what is allowed otherwise.
    """
    segments = name.split("/")
    if (
        len(name) > MAX_LEN
        or not _NAME_RE.fullmatch(name)
        or any(seg in ("", ".", "..") for seg in segments)
    ):
        raise InvalidArgument(f"invalid image name {name!r}: {_NAME_RULE}")
    return name


def validate_tag(tag: str) -> str:
    """Return ``tag`` unchanged when it is a valid tag; else :class:`InvalidArgument`."""
    if len(tag) > MAX_LEN or not _TAG_RE.fullmatch(tag):
        raise InvalidArgument(f"invalid image tag {tag!r}: {_TAG_RULE}")
    return tag


def parse_ref(ref: str) -> tuple[str, str]:
    """Split ``'name[:tag]'`` into ``(name, tag)``; the tag defaults to ``'latest'``.

    Raises :class:`InvalidArgument` when the name or the tag is not valid.
    """
    if not isinstance(ref, str) or not ref:
        raise InvalidArgument(f"image reference must be 'name[:tag]', got {ref!r}")
    name, sep, tag = ref.partition(":")
    if sep and not tag:
        raise InvalidArgument(f"image reference {ref!r} has an empty tag: {_TAG_RULE}")
    return validate_name(name), validate_tag(tag or DEFAULT_TAG)


def format_ref(name: str, tag: str) -> str:
    """``'name:tag'``."""
    return f"{name}:{tag}"
