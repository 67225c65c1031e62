"""Images loaded on demand: a ≥ 1 GiB Debian image served by nginx, cold and warm.

The image (``bench/sci:1``: bookworm with python3, numpy, scipy, pandas,
scikit-learn, matplotlib, pytest, git, gcc, g++, gfortran and clang; about
1.7 GB packed) is built once by debootstrap into a cache store
(``--cache``, default /var/tmp/sandfleet-bench/images), with the main demo's
workspace layer (more-itertools 10.5.0 with its tests). Both are copied into a
blob store directory served by a real nginx (Debian's) on loopback. Every
node below starts with an **empty** image store and an **empty** chunk cache
and pulls from ``http://127.0.0.1:<port>``. Measured, nothing asserted:

1. cold: create → first exec completed (``python3 -c 'import sys'``); then
   one rollout as the demo runs it (apply a patch, run the project's tests) on
   another sandbox of the same node; bytes fetched from nginx as a share of
   the image (metadata + data). Then ``--runs`` warm creates (cache hot): p50.
2. eager, in the same run: a fresh node that first downloads the whole image
   (``pull --data``: every chunk over HTTP, digest-checked) and then creates
   and runs the first exec: the time a platform that copies the whole image
   before starting pays. Ratio eager / cold.
3. burst: a fresh node, 32 sandboxes created at once from the cold image, each
   running the first exec: wall time, and chunks/bytes fetched against the
   distinct chunks read (each chunk fetched once).

Run as root: ``python benchmarks/bench_ondemand.py [--runs N] [--burst N]``.
Writes only stdout; the work directory under /var/tmp is removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from sandfleet.blobstore import FileBlobStore, open_store
from sandfleet.blobstore.transfer import pull, push
from sandfleet.cli.local import LocalDeployment
from sandfleet.demo.patches import TARGET, candidates
from sandfleet.demo.rollouts import WORKSPACE_IMAGE, WORKSPACE_SOURCE, _episode
from sandfleet.images import ImageStore, build_debootstrap, build_workspace
from sandfleet.node.leaks import leftovers
from sandfleet.sdk import AsyncClient, Client

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.nginx import nginx_server  # the tests' nginx, reused

IMAGE = "bench/sci:1"
PACKAGES = [
    "python3", "python3-numpy", "python3-scipy", "python3-pandas", "python3-sklearn",
    "python3-matplotlib", "python3-pytest", "git", "gcc", "g++", "gfortran", "clang",
]  # fmt: skip
FIRST_EXEC = ["python3", "-c", "import sys"]


def ensure_images(cache: Path, console: Console) -> ImageStore:
    store = ImageStore(cache)
    if not store.has_image(IMAGE):
        console.print(f"building {IMAGE} with debootstrap (a few minutes, once)")
        build_debootstrap(store, IMAGE, PACKAGES)
    if not store.has_image(WORKSPACE_IMAGE):
        build_workspace(store, WORKSPACE_IMAGE, WORKSPACE_SOURCE)
    return store


def image_bytes(store: ImageStore, ref: str) -> int:
    return sum(x.size for x in store.resolve(ref).layers)


@contextmanager
def node(work: Path, name: str, url: str | None) -> Iterator[LocalDeployment]:
    extra = ["--blob-store", url] if url else []
    dep = LocalDeployment(work / name / "state", work / name / "images", extra_args=extra)
    with dep:
        yield dep
    left = leftovers(dep.state_dir)
    if left:
        print(f"LEFT BEHIND on {name}: {left}", file=sys.stderr)


def stats(dep: LocalDeployment) -> dict[str, Any]:
    return dict(dep.node_get("/v1/layers/stats"))


def create_and_first_exec(client: Client) -> tuple[float, str]:
    t0 = time.perf_counter()
    sb = client.create(image=IMAGE)
    try:
        r = sb.exec(FIRST_EXEC, timeout_s=120)
        assert r.ok, r
        return time.perf_counter() - t0, sb.id
    finally:
        sb.destroy()


async def rollout(url: str) -> tuple[float, float]:
    async with AsyncClient(url) as client:
        t0 = time.perf_counter()
        async with await client.create(image=IMAGE, workspace=WORKSPACE_IMAGE) as sb:
            original = (await sb.files.read(f"/workspace/{TARGET}")).decode()
            result = await _episode(original)(sb, (0, candidates(1)[0]))
        return time.perf_counter() - t0, result.reward


async def burst(url: str, n: int) -> float:
    async with AsyncClient(url, timeout_s=300) as client:

        async def one() -> None:
            async with await client.create(image=IMAGE) as sb:
                r = await sb.exec(FIRST_EXEC, timeout_s=300)
                assert r.ok, r

        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", type=Path, default=Path("/var/tmp/sandfleet-bench/images"))
    ap.add_argument("--runs", type=int, default=5, help="warm creates")
    ap.add_argument("--burst", type=int, default=32)
    args = ap.parse_args()
    console = Console()
    source = ensure_images(args.cache, console)
    size = image_bytes(source, IMAGE)
    ws_size = image_bytes(source, WORKSPACE_IMAGE)
    work = Path(tempfile.mkdtemp(prefix="bench-ondemand-", dir="/var/tmp"))
    rows: list[tuple[str, str]] = []
    try:
        served = work / "nginx-root"
        served.mkdir()
        for ref in (IMAGE, WORKSPACE_IMAGE):
            push(source.blobs, FileBlobStore(served), ref)
        with nginx_server(served, dav=False) as url:
            rows.append(("image", f"{IMAGE}: {size / 2**30:.2f} GiB ({size:,} bytes), 1 layer"))
            rows.append(("blob store", f"nginx on loopback, {url}; node cache empty"))

            with node(work, "cold", url) as dep, Client(dep.url, timeout_s=300) as client:
                cold_s, _ = create_and_first_exec(client)
                after_first = stats(dep)["fetcher"]["remote_bytes"]
                roll_s, reward = asyncio.run(rollout(dep.url))
                after_roll = stats(dep)["fetcher"]["remote_bytes"]
                warm = [create_and_first_exec(client)[0] for _ in range(args.runs)]
            rows.append(("cold create → first exec", f"{cold_s:.2f} s"))
            rows.append(
                (
                    "bytes fetched by then",
                    f"{after_first / 2**20:.1f} MiB = {after_first / size:.1%} of the image",
                )
            )
            rows.append(
                ("then one demo rollout (+ workspace layer)", f"{roll_s:.2f} s, reward {reward}")
            )
            rows.append(
                (
                    "bytes fetched after the rollout",
                    f"{after_roll / 2**20:.1f} MiB = {after_roll / (size + ws_size):.1%}"
                    " of image + workspace",
                )
            )
            rows.append(
                (
                    f"warm create → first exec, p50 of {args.runs}",
                    f"{statistics.median(warm) * 1000:.0f} ms (min {min(warm) * 1000:.0f})",
                )
            )

            with node(work, "eager", None) as dep, Client(dep.url, timeout_s=300) as client:
                t0 = time.perf_counter()
                with open_store(url) as remote:
                    pull(remote, FileBlobStore(dep.images_dir), IMAGE, data=True)
                dl = time.perf_counter() - t0
                first, _ = create_and_first_exec(client)
                eager = dl + first
            rows.append(
                (
                    "eager: download whole image, then create → first exec",
                    f"{eager:.2f} s ({dl:.2f} s download) = {eager / cold_s:.1f}x cold",
                )
            )

            with node(work, "burst", url) as dep:
                wall = asyncio.run(burst(dep.url, args.burst))
                s = stats(dep)["fetcher"]
            rows.append(
                (
                    f"{args.burst} creates at once, cold → all first execs done",
                    f"{wall:.2f} s",
                )
            )
            rows.append(
                (
                    f"  fetched by those {args.burst}",
                    f"{s['remote_chunks']} chunks, {s['remote_bytes'] / 2**20:.1f} MiB"
                    f" (one sandbox alone: {after_first / 2**20:.1f} MiB)",
                )
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = Table("measure", "value", title="layers on demand (bench_ondemand.py)")
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)


if __name__ == "__main__":
    main()
