"""Conformance: files in and out of a sandbox, byte-exact and confined to it (CASES K7)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from pathlib import Path

import pytest

from sandfleet import errors
from sandfleet.sdk import Sandbox
from tests.conformance.conftest import host_probe_name

pytestmark = pytest.mark.root

#: The busybox image's /etc/passwd; the host's differs.
SANDBOX_PASSWD = b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n"

SIZES = {"empty": 0, "one-byte": 1, "1MiB": 1 << 20, "1MiB+3": (1 << 20) + 3}


@pytest.mark.parametrize("size", SIZES.values(), ids=SIZES.keys())
def test_write_read_round_trip(sandbox: Sandbox, size: int) -> None:
    """K7: random bytes written and read back are identical, and the sandbox sees them too."""
    blob = os.urandom(size)
    entry = sandbox.files.write("/tmp/blob", blob)
    assert entry.size == size and entry.type == "file"
    assert sandbox.files.read("/tmp/blob") == blob
    assert sandbox.files.stat("/tmp/blob").size == size
    digest = sandbox.exec(["sha256sum", "/tmp/blob"]).stdout.split()[0].decode()
    assert digest == hashlib.sha256(blob).hexdigest()


@pytest.mark.parametrize("size", SIZES.values(), ids=SIZES.keys())
def test_upload_download_round_trip(sandbox: Sandbox, tmp_path: Path, size: int) -> None:
    """K7: random bytes uploaded and downloaded are identical, also a 0-byte file."""
    src, back = tmp_path / "src", tmp_path / "back"
    src.write_bytes(os.urandom(size))
    assert sandbox.files.upload(src, "/root/up.bin").size == size
    assert sandbox.files.read("/root/up.bin") == src.read_bytes()
    assert sandbox.files.download("/root/up.bin", back) == size
    assert back.read_bytes() == src.read_bytes()


def test_a_file_made_inside_downloads_exactly(sandbox: Sandbox, tmp_path: Path) -> None:
    """K7: bytes produced by a command come out of download and read unchanged."""
    sandbox.exec("head -c 3000000 /dev/urandom > /tmp/made")
    want = sandbox.exec(["sha256sum", "/tmp/made"]).stdout.split()[0].decode()
    assert sandbox.files.download("/tmp/made", tmp_path / "made") == 3_000_000
    assert hashlib.sha256((tmp_path / "made").read_bytes()).hexdigest() == want
    assert hashlib.sha256(sandbox.files.read("/tmp/made")).hexdigest() == want


@pytest.mark.parametrize(
    "path", ["/tmp/with space/a b.txt", "/tmp/ünï cødé/ü.txt", "/tmp/quote's/$HOME;x"], ids=repr
)
def test_unusual_paths(sandbox: Sandbox, path: str) -> None:
    """K7: paths with spaces, non-ASCII and shell characters are used exactly as given."""
    parent, name = path.rsplit("/", 1)
    sandbox.files.mkdir(parent)
    sandbox.files.write(path, b"content")
    assert sandbox.files.read(path) == b"content"
    assert name in [e.name for e in sandbox.files.list(parent)]
    assert sandbox.exec(["cat", path]).stdout == b"content"
    sandbox.files.remove(parent, recursive=True)
    with pytest.raises(errors.NotFound):
        sandbox.files.stat(path)


def test_a_symlink_to_the_root_stays_inside(sandbox: Sandbox, tmp_path: Path) -> None:
    """K7: writes, reads, mkdir and remove through a link to `/` act on the sandbox's own root."""
    probe = host_probe_name()
    victim = Path("/tmp") / host_probe_name()
    victim.write_bytes(b"host file")
    try:
        assert sandbox.exec("ln -s / /tmp/escape").ok
        sandbox.files.write(f"/tmp/escape/tmp/{probe}", b"inside")
        assert not Path("/tmp", probe).exists()
        assert sandbox.exec(["cat", f"/tmp/{probe}"]).stdout == b"inside"
        sandbox.files.mkdir(f"/tmp/escape/tmp/{probe}-dir")
        assert not Path("/tmp", f"{probe}-dir").exists()
        assert sandbox.files.read("/tmp/escape/etc/passwd") == SANDBOX_PASSWD
        sandbox.files.download("/tmp/escape/etc/passwd", tmp_path / "p")
        assert (tmp_path / "p").read_bytes() == SANDBOX_PASSWD
        with pytest.raises(errors.NotFound):
            sandbox.files.remove(f"/tmp/escape{victim}")
        with pytest.raises(errors.NotFound):
            sandbox.files.read(f"/tmp/escape{victim}")
        assert victim.read_bytes() == b"host file"
        names = {e.name for e in sandbox.files.list("/tmp/escape/")}
        assert "work dir" in names and "work" not in names  # the image's root, not the host's
    finally:
        victim.unlink()


def test_symlinks_to_files_outside_stay_inside(sandbox: Sandbox, tmp_path: Path) -> None:
    """K7: a link to a host path resolves in the sandbox; writes through it change no host file."""
    host_passwd = Path("/etc/passwd").read_bytes()
    host_only = Path(__file__).resolve()  # exists on the host, not in the sandbox
    assert sandbox.exec(f"ln -s /etc/passwd /tmp/p; ln -s '{host_only}' /tmp/h").ok
    assert sandbox.files.read("/tmp/p") == SANDBOX_PASSWD
    with pytest.raises(errors.NotFound):
        sandbox.files.read("/tmp/h")
    with pytest.raises(errors.NotFound):
        sandbox.files.download("/tmp/h", tmp_path / "h")
    before = host_only.read_bytes()
    with contextlib.suppress(errors.SandfleetError):  # refusing is fine too
        sandbox.files.write("/tmp/h", b"overwritten")
    sandbox.files.write("/tmp/p", b"overwritten")
    (tmp_path / "up").write_bytes(b"uploaded")
    sandbox.files.upload(tmp_path / "up", "/tmp/p")
    assert host_only.read_bytes() == before
    assert Path("/etc/passwd").read_bytes() == host_passwd


@pytest.mark.parametrize(
    ("op", "path"),
    [
        ("read", "/no/such/file"),
        ("stat", "/no/such/file"),
        ("list", "/no/such/dir"),
        ("remove", "/no/such/file"),
        ("write", "/no/such/dir/file"),
        ("download", "/no/such/file"),
    ],
)
def test_missing_paths_are_not_found(sandbox: Sandbox, tmp_path: Path, op: str, path: str) -> None:
    """K7: an operation on a path that does not exist raises NotFound and creates nothing."""
    calls = {
        "read": lambda: sandbox.files.read(path),
        "stat": lambda: sandbox.files.stat(path),
        "list": lambda: sandbox.files.list(path),
        "remove": lambda: sandbox.files.remove(path),
        "write": lambda: sandbox.files.write(path, b"x"),
        "download": lambda: sandbox.files.download(path, tmp_path / "out"),
    }
    with pytest.raises(errors.NotFound):
        calls[op]()
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("op", "path"),
    [
        ("read", "/tmp"),
        ("write", "/tmp"),
        ("download", "/tmp"),
        ("list", "/etc/passwd"),
        ("read", "/etc/passwd/x"),
        ("remove-nonempty", "/etc"),
    ],
)
def test_wrong_file_types_are_invalid_argument(
    sandbox: Sandbox, tmp_path: Path, op: str, path: str
) -> None:
    """K7: a directory where a file is expected (and the reverse) is InvalidArgument."""
    calls = {
        "read": lambda: sandbox.files.read(path),
        "write": lambda: sandbox.files.write(path, b"x"),
        "download": lambda: sandbox.files.download(path, tmp_path / "out"),
        "list": lambda: sandbox.files.list(path),
        "remove-nonempty": lambda: sandbox.files.remove(path),
    }
    with pytest.raises((errors.InvalidArgument, errors.FailedPrecondition)):
        calls[op]()
    assert sandbox.files.stat("/etc/passwd").type == "file"


@pytest.mark.parametrize(
    "path", ["/sys/kernel/sf-x", "/proc/sys/kernel/hostname", "/proc/sys/vm/drop_caches"]
)
def test_read_only_paths_are_refused(sandbox: Sandbox, path: str) -> None:
    """K7: writing a read-only path is PermissionDenied or InvalidArgument, never success."""
    before = sandbox.exec(["cat", path]).stdout
    with pytest.raises((errors.PermissionDenied, errors.InvalidArgument)):
        sandbox.files.write(path, b"1\n")
    assert sandbox.exec(["cat", path]).stdout == before


def test_a_new_file_in_proc_is_refused(sandbox: Sandbox) -> None:
    """K7: creating /proc/x fails (the kernel says ENOENT there) and creates nothing."""
    with pytest.raises((errors.PermissionDenied, errors.InvalidArgument, errors.NotFound)):
        sandbox.files.write("/proc/sf-x", b"1")
    with pytest.raises(errors.NotFound):
        sandbox.files.stat("/proc/sf-x")


def test_special_files_do_not_hang_the_file_api(sandbox: Sandbox) -> None:
    """K7/K2: reading a FIFO or a device is refused at once, never blocks waiting for a writer."""
    assert sandbox.exec("mkfifo /tmp/fifo").ok
    for path in ("/tmp/fifo", "/dev/zero", "/dev/urandom"):
        t0 = time.monotonic()
        with pytest.raises(errors.InvalidArgument):
            sandbox.files.read(path)
        assert time.monotonic() - t0 < 3


@pytest.mark.parametrize("mode", [0o755, 0o600, 0o644, 0o4755], ids=oct)
def test_write_sets_the_mode(sandbox: Sandbox, mode: int) -> None:
    """K7: files.write gives the file exactly the mode asked for; 0755 makes it runnable."""
    sandbox.files.write("/tmp/script", b"#!/bin/sh\necho ran\n", mode=mode)
    assert sandbox.files.stat("/tmp/script").mode & 0o7777 == mode
    assert sandbox.exec(["stat", "-c", "%a", "/tmp/script"]).stdout == f"{mode:o}\n".encode()
    r = sandbox.exec(["/tmp/script"])
    assert r.exit_code == (0 if mode & 0o100 else 126)
