"""Which Debian mirror debootstrap should use.

Precedence, resolved here and only here: the caller's argument, then the
environment variable ``SANDFLEET_DEBIAN_MIRROR``, then the host's apt
sources. No mirror URL is built in.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from sandfleet.wire.errors import InvalidArgument

__all__ = ["ENV_MIRROR", "AptSource", "read_apt_sources", "resolve_mirror"]

ENV_MIRROR = "SANDFLEET_DEBIAN_MIRROR"

#: Debian release codenames and archive aliases: the "plain" suites.
DEBIAN_SUITES = frozenset(
    [
        "buzz",
        "rex",
        "bo",
        "hamm",
        "slink",
        "potato",
        "woody",
        "sarge",
        "etch",
        "lenny",
        "squeeze",
        "wheezy",
        "jessie",
        "stretch",
        "buster",
        "bullseye",
        "bookworm",
        "trixie",
        "forky",
        "duke",
        "sid",
        "stable",
        "testing",
        "unstable",
        "oldstable",
        "oldoldstable",
    ]
)


@dataclass(frozen=True)
class AptSource:
    """One ``deb`` entry of the host's apt configuration (one URI)."""

    uri: str
    suites: tuple[str, ...]
    components: tuple[str, ...]
    options: dict[str, str] = field(default_factory=dict)
    origin: str = ""
    """File (and line) it came from, for messages."""

    def is_debian_archive(self, suite: str) -> bool:
        """True for a Debian archive mirror carrying ``suite`` or a plain Debian suite.

        Third-party repositories are told apart by their component (Debian's
        are ``main``/``contrib``/...; ``stable`` on docker's), their
        ``Signed-By`` key (Debian's archive keyring or none) and their URI
        (a ``debian`` path segment or a ``*.debian.org`` host).
        """
        plain = [s for s in self.suites if s == suite or s in DEBIAN_SUITES]
        if not plain or "main" not in self.components:
            return False
        signed_by = self.options.get("signed-by", "")
        if signed_by and "debian-archive" not in signed_by:
            return False
        parts = urlsplit(self.uri)
        if parts.scheme not in ("http", "https", "ftp", "file"):
            return False
        host = (parts.hostname or "").lower()
        segments = [s for s in parts.path.split("/") if s]
        if "debian-security" in segments:
            return False
        return "debian" in segments or host == "debian.org" or host.endswith(".debian.org")


def resolve_mirror(
    mirror: str | None = None,
    *,
    suite: str = "bookworm",
    apt_dir: Path = Path("/etc/apt"),
    environ: Mapping[str, str] | None = None,
) -> str:
    """The Debian mirror URL to bootstrap ``suite`` from.

    Order: ``mirror``, then ``$SANDFLEET_DEBIAN_MIRROR``, then the first
    ``deb`` entry in the host's apt sources (``apt_dir``/sources.list, then
    sources.list.d/*.list and *.sources in name order) that is a Debian
    archive carrying a plain suite such as ``bookworm`` (not -security or
    -updates, not a third-party repository).

    Raises :class:`InvalidArgument` explaining how to set
    ``SANDFLEET_DEBIAN_MIRROR`` when none is found.
    """
    env = os.environ if environ is None else environ
    for candidate in (mirror, env.get(ENV_MIRROR)):
        if candidate and candidate.strip():
            return candidate.strip()
    for src in read_apt_sources(apt_dir):
        if src.is_debian_archive(suite):
            return src.uri
    raise InvalidArgument(
        f"no Debian mirror to bootstrap {suite!r} from: none was given, {ENV_MIRROR} is not set, "
        f"and no Debian archive with a plain suite is configured in {apt_dir}. Set "
        f"{ENV_MIRROR} to a Debian mirror URL (the directory that holds dists/ and pool/), "
        "or pass mirror= to the builder."
    )


def read_apt_sources(apt_dir: Path = Path("/etc/apt")) -> list[AptSource]:
    """Every enabled ``deb`` entry in ``apt_dir``, in the order apt reads them.

    Understands one-line ``.list`` files (with ``[option=value ...]``) and
    deb822 ``.sources`` files. Unreadable files are skipped.
    """
    apt_dir = Path(apt_dir)
    files = [apt_dir / "sources.list"]
    d = apt_dir / "sources.list.d"
    if d.is_dir():
        files += sorted(p for p in d.iterdir() if p.suffix in (".list", ".sources"))
    found: list[AptSource] = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        parse = _parse_deb822 if path.suffix == ".sources" else _parse_one_line
        found.extend(parse(text, str(path)))
    return found


def _parse_one_line(text: str, origin: str) -> Iterator[AptSource]:
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        m = re.match(r"(deb|deb-src)\s+(?:\[([^\]]*)\]\s*)?(\S+)\s+(\S+)\s*(.*)$", line)
        if not m or m.group(1) != "deb":
            continue
        options = {}
        for opt in (m.group(2) or "").split():
            key, _, value = opt.partition("=")
            options[key.rstrip("+-").lower()] = value
        yield AptSource(
            uri=m.group(3),
            suites=(m.group(4),),
            components=tuple(m.group(5).split()),
            options=options,
            origin=f"{origin}:{lineno}",
        )


def _parse_deb822(text: str, origin: str) -> Iterator[AptSource]:
    for para in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        key = None
        for raw in para.splitlines():
            if raw.startswith("#"):
                continue
            if raw[:1].isspace() and key is not None:  # continuation line
                fields[key] += "\n" + raw.strip()
                continue
            k, sep, v = raw.partition(":")
            if sep and k.strip():
                key = k.strip().lower()
                fields[key] = v.strip()
        if "deb" not in fields.get("types", "").split():
            continue
        if fields.get("enabled", "yes").lower() in ("no", "false", "0"):
            continue
        options = {
            k: v for k, v in fields.items() if k not in ("types", "uris", "suites", "components")
        }
        for uri in fields.get("uris", "").split():
            yield AptSource(
                uri=uri,
                suites=tuple(fields.get("suites", "").split()),
                components=tuple(fields.get("components", "").split()),
                options=options,
                origin=origin,
            )
