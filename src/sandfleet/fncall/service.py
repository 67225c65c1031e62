"""The node's fncall service: pools of warm workers and the calls handed to them.

A worker is a box of the container backend whose PID 1 is the zygote of
:mod:`sandfleet.fncall.worker` on a read-only root of the image's layers, with
tmpfs ``/tmp`` and ``/dev/shm``, no network and its own cgroup. Between calls
the zygote kills everything the call started and wipes what it wrote; a call's
memory limit is the cgroup's, set before each call when it changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import posixpath
import secrets
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sandfleet.backends.base import BoxInit, LayerSource, SandboxSpec
from sandfleet.backends.container.backend import ContainerBackend
from sandfleet.fncall.conn import WorkerConnection
from sandfleet.fncall.pool import Pool, Worker

if TYPE_CHECKING:
    from sandfleet.node.images import NodeImages
from sandfleet.wire.errors import (
    FailedPrecondition,
    Internal,
    InvalidArgument,
    SandfleetError,
)
from sandfleet.wire.models import (
    PoolConfig,
    PoolInfo,
    RunRequest,
    RunResult,
    StageResult,
)

__all__ = ["WORKER_CPU", "WORKER_PIDS", "FnCallService"]

log = logging.getLogger("sandfleet.fncall")

WORKER_PATH = "/.sandfleet/fnworker.py"
#: Cores each worker may use (CFS quota), and its process limit: a fork bomb
#: meets the limit in microseconds and the zygote's kill sweep then ends it.
WORKER_CPU = 1.0
WORKER_PIDS = 128
#: Size of each tmpfs, MiB; what a call writes there is charged to its memory limit too.
TMPFS_MB = {"/tmp": 1024}
#: Seconds a call's answer may take beyond its own time limits before the
#: worker is deemed hung and replaced.
HANG_MARGIN_S = 10.0
#: Outcomes after which a worker is replaced rather than reused.
RECYCLE_ON = ("timeout", "oom")
#: Calls a worker serves before it is replaced, to bound any slow drift of the zygote.
WORKER_MAX_CALLS = 10_000
#: Memory limit a worker starts with, MiB (the zygote needs about 20).
START_MEMORY_MB = 128
_MAINTAIN_EVERY_S = 1.0
#: What PID 1 needs: write a call's files and hand them to its user (CHOWN), empty
#: what calls left whatever its modes (DAC_OVERRIDE, FOWNER), kill every call
#: process (KILL), become the calls' user (SETUID, SETGID). Calls keep none.
_ZYGOTE_CAPS = [
    *("CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_KILL", "CAP_SETGID", "CAP_SETUID"),
]


def _worker_source() -> Path:
    return Path(__file__).with_name("worker.py")


class FnCallService:
    """Pools of fncall workers on one node, keyed by (image, language).

    ``backend`` starts and stops the worker boxes; ``defaults`` are the bounds
    of a pool made on a first call (see :class:`PoolConfig`).
    """

    def __init__(
        self,
        node_id: str,
        images: NodeImages,
        backend: ContainerBackend,
        defaults: PoolConfig | None = None,
    ) -> None:
        self.node_id = node_id
        self.images = images
        self.backend = backend
        self.defaults = defaults or PoolConfig()
        self.pools: dict[tuple[str, str], Pool] = {}
        self._layers: dict[str, tuple[list[LayerSource], dict[str, str]]] = {}
        self._maintainer: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._maintainer = asyncio.ensure_future(self._maintain())

    async def close(self) -> None:
        """Stop every worker of every pool."""
        if self._maintainer is not None:
            self._maintainer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._maintainer
        await asyncio.gather(*(p.close() for p in self.pools.values()))

    async def _maintain(self) -> None:
        while True:
            await asyncio.sleep(_MAINTAIN_EVERY_S)
            for pool in list(self.pools.values()):
                pool.trim()
                self._measure(pool)

    # ------------------------------------------------------------------ pools

    def pool_infos(self) -> list[PoolInfo]:
        return [p.info() for p in self.pools.values()]

    def configure(self, config: PoolConfig) -> PoolInfo:
        """Set a pool's bounds (making the pool if new); workers start or stop to fit.

        Raises InvalidArgument when ``min_workers > max_workers``, NotFound for an
        unknown image.
        """
        if config.min_workers > config.max_workers:
            raise InvalidArgument(
                f"min_workers={config.min_workers} is above max_workers={config.max_workers}"
            )
        key = (config.image, config.language)
        pool = self.pools.get(key)
        if pool is None:
            if not self.images.remotes:  # else it may be pulled when a worker starts
                self.images.store.resolve(config.image)
            pool = self.pools[key] = Pool(self.node_id, config, self._start_worker, self._stop)
            pool.grow()
        else:
            pool.reconfigure(config)
        return pool.info()

    def _pool(self, image: str, language: str) -> Pool:
        pool = self.pools.get((image, language))
        if pool is None:
            cfg = self.defaults.model_copy(update={"image": image, "language": language})
            self.configure(cfg)
            pool = self.pools[(image, language)]
        return pool

    async def _resolve(self, image: str) -> tuple[list[LayerSource], dict[str, str]]:
        cached = self._layers.get(image)
        if cached is None:
            layers, config = await self.images.stack(image, None)
            cached = self._layers[image] = (layers, dict(config.env))
        return cached

    # ------------------------------------------------------------------ workers

    async def _start_worker(self, pool: Pool) -> Worker:
        layers, env = await self._resolve(pool.config.image)
        conns: list[WorkerConnection] = []

        async def ready(sock: Path) -> None:
            while True:
                try:
                    conns.append(await WorkerConnection.open(sock))
                    return
                except (ConnectionRefusedError, FileNotFoundError):
                    await asyncio.sleep(0.005)

        worker_id = f"fw-{secrets.token_hex(6)}-{self.node_id}"
        spec = SandboxSpec(
            id=worker_id,
            kind=self.backend.kind,
            layers=layers,
            cpu=WORKER_CPU,
            memory_mb=START_MEMORY_MB,  # each call sets its own
            pids_limit=WORKER_PIDS,
            disk_mb=None,  # read-only root: no writable layer
            env={**env, "PYTHONDONTWRITEBYTECODE": "1"},
            init=BoxInit(
                args=["python3", "-I", WORKER_PATH],
                ready=ready,
                binds={WORKER_PATH: _worker_source()},
                tmpfs=dict(TMPFS_MB),
                caps=list(_ZYGOTE_CAPS),
            ),
        )
        try:
            handle = await self.backend.create(spec)
        except SandfleetError as exc:
            raise FailedPrecondition(
                f"cannot start an fncall worker from {pool.config.image} (it needs python3"
                f" 3.9 or later on its PATH): {exc.message}"
            ) from exc
        conn = conns[0]
        assert handle.pid is not None
        if pool.config.language not in conn.hello.get("languages", []):
            conn.close()
            await self.backend.destroy(worker_id)
            raise FailedPrecondition(
                f"image {pool.config.image} cannot run {pool.config.language} (it has:"
                f" {', '.join(conn.hello.get('languages', []))}); build it with the toolchain"
            )
        # The OOM killer must pick the call's process, never the zygote.
        with contextlib.suppress(OSError):
            Path(f"/proc/{handle.pid}/oom_score_adj").write_text("-1000")
        return Worker(
            id=worker_id,
            conn=conn,
            pid=handle.pid,
            ooms=self.backend.oom_kills(worker_id),
        )

    async def _stop(self, worker: Worker) -> None:
        worker.conn.close()
        await self.backend.destroy(worker.id)

    def _measure(self, pool: Pool) -> None:
        """Mean memory charge of the idle workers' cgroups, MiB."""
        sizes = [self.backend.cgroups.memory_usage(f"/sandfleet/{w.id}") for w in pool.idle]
        sizes = [s for s in sizes if s > 0]
        if sizes:
            pool.memory_mb = round(sum(sizes) / len(sizes) / (1 << 20), 2)

    # ------------------------------------------------------------------ calls

    async def run(self, req: RunRequest) -> RunResult:
        """Run one call in a worker of its pool.

        Raises InvalidArgument for bad paths, NotFound for an unknown image,
        ResourceExhausted when the pool's queue is full, FailedPrecondition when
        the image cannot run the language, Internal when the worker died
        during the call for a reason other than memory (it is replaced).
        """
        payload = _payload(req)
        carried = len(req.stdin) + sum(len(d) for d in req.files.values()) + len(req.code)
        if carried > req.memory_mb << 20:
            raise InvalidArgument(
                f"stdin, files and code are {carried / (1 << 20):.1f} MiB, more than the call's"
                f" memory_mb={req.memory_mb}: they live in its memory; raise memory_mb"
            )
        pool = self._pool(req.image, req.language)
        worker = await pool.acquire()
        healthy = False
        try:
            self._limit_memory(worker, req.memory_mb, carried)
            bound = req.timeout_s + HANG_MARGIN_S
            if req.language in ("c", "cpp"):
                bound += req.compile_timeout_s
            try:
                answer = await asyncio.wait_for(worker.conn.call(payload), bound)
            except (TimeoutError, ConnectionError, EOFError, OSError, ValueError) as exc:
                if self._oom_since(worker):
                    return _oom_result(worker.id)
                raise Internal(
                    f"fncall worker {worker.id} failed during the call ({type(exc).__name__}:"
                    f" {exc}); it has been replaced"
                ) from exc
            if "invalid" in answer:
                healthy = True
                raise InvalidArgument(answer["invalid"])
            if "error" in answer:
                healthy = True
                raise FailedPrecondition(f"the worker refused the call: {answer['error']}")
            result = self._result(answer, worker, req.fetch_files)
            pool.calls += 1
            worker.calls += 1
            # The zygote has already killed and wiped what the call left, but a
            # call that ran out of time or memory may have strained what no scrub
            # reaches (the cgroup's reclaim, the kernel's caches): a fresh worker
            # takes the next call. So does one that has served its share.
            strained = any(
                s is not None and s.status in RECYCLE_ON for s in (result.compile, result.run)
            )
            healthy = not strained and worker.calls < WORKER_MAX_CALLS
            return result
        finally:
            pool.release(worker, healthy)

    def _limit_memory(self, worker: Worker, memory_mb: int, carried: int) -> None:
        """Give the call ``memory_mb`` on top of what the worker holds now.

        The zygote and the process forked for the call are charged to the
        cgroup too, and what they hold drifts (a big call leaves the zygote's
        heap larger): measured before each call, so a call's room never depends
        on the calls before it. ``carried`` bytes of stdin and files pass through
        the zygote (base64 in a frame, then decoded) on their way to the call,
        which gets them once: room for those copies is added. Written only when
        the limit moved by a MiB or more.
        """
        rel = f"/sandfleet/{worker.id}"
        limit = (memory_mb << 20) + self.backend.cgroups.memory_usage(rel) + 3 * carried
        if worker.limit_bytes is not None and abs(limit - worker.limit_bytes) < 1 << 20:
            return
        try:
            self.backend.cgroups.set_memory_limit(rel, limit)
        except OSError as exc:
            raise Internal(f"cannot set the memory limit of worker {worker.id}: {exc}") from exc
        worker.limit_bytes = limit

    def _oom_since(self, worker: Worker) -> bool:
        now = self.backend.oom_kills(worker.id)
        rose = now > worker.ooms
        worker.ooms = now
        return rose

    def _result(self, answer: dict[str, Any], worker: Worker, fetch_files: list[str]) -> RunResult:
        stages: dict[str, StageResult | None] = {}
        # Read after every call, so that a kill the call survived (a child of it,
        # say) is never blamed on a later call. At most one stage fails.
        killed = self._oom_since(worker)
        for name in ("compile", "run"):
            doc = answer.get(name)
            stage = StageResult.model_validate(doc) if doc else None
            failed = stage is not None and not stage.ok and stage.status != "timeout"
            if stage is not None and failed and killed:
                # Like a timeout: never an exit code that could pass for a real one.
                stage = stage.model_copy(
                    update={"status": "oom", "exit_code": None, "signal": int(signal.SIGKILL)}
                )
            stages[name] = stage
        last_name = "run" if stages["run"] is not None else "compile"
        last = stages[last_name]
        if last is None:
            raise Internal("the worker answered without any stage")
        return RunResult(
            **last.model_dump(),
            stage=last_name,
            compile=stages["compile"],
            run=stages["run"],
            **_as_requested(answer, fetch_files),
            worker=worker.id,
        )


def _as_requested(answer: dict[str, Any], fetch_files: list[str]) -> dict[str, Any]:
    """The worker's fetch results keyed by the paths as the caller wrote them."""
    files, missing, errors = (
        answer.get("files") or {},
        answer.get("missing_files") or [],
        (answer.get("fetch_errors") or {}),
    )
    out: dict[str, Any] = {"files": {}, "missing_files": [], "fetch_errors": {}}
    for path in fetch_files:
        key = _relative(path, "fetch_files")
        if key in files:
            out["files"][path] = files[key]
        elif key in errors:
            out["fetch_errors"][path] = errors[key]
        elif key in missing:
            out["missing_files"].append(path)
    return out


def _oom_result(worker_id: str) -> RunResult:
    return RunResult(status="oom", signal=int(signal.SIGKILL), worker=worker_id)


def _relative(path: str, what: str) -> str:
    """``path`` as a normalized path relative to the call's working dir ``/tmp``."""
    if not path or "\0" in path:
        raise InvalidArgument(f"{what} path {path!r} must be a non-empty path without NUL")
    if path.startswith("/"):
        norm = posixpath.normpath(path)
        if not norm.startswith("/tmp/"):
            raise InvalidArgument(
                f"{what} path {path!r} is outside the call's working directory: give a path"
                " relative to it, or an absolute one under /tmp"
            )
        return norm[len("/tmp/") :]
    norm = posixpath.normpath(path)
    if norm == ".":
        raise InvalidArgument(
            f"{what} path {path!r} is the call's working directory itself: name a file in it"
        )
    if norm == ".." or norm.startswith("../"):
        raise InvalidArgument(
            f"{what} path {path!r} leaves the call's working directory: drop the '..'"
        )
    return norm


def _payload(req: RunRequest) -> dict[str, Any]:
    """The frame sent to the worker; validates what the worker trusts."""
    import base64

    for k, v in req.env.items():
        if not k or "=" in k or "\0" in k or "\0" in v:
            raise InvalidArgument(
                f"environment variable {k!r}: names must be non-empty without '=' or NUL,"
                " values without NUL"
            )
    if any("\0" in a for a in req.args):
        raise InvalidArgument("args must not contain NUL bytes")
    if "\0" in req.code and req.language != "python":
        raise InvalidArgument(f"{req.language} code must not contain NUL bytes")
    files = {
        _relative(p, "files"): base64.b64encode(data).decode("ascii")
        for p, data in req.files.items()
    }
    return {
        "language": req.language,
        "code": req.code,
        "stdin": base64.b64encode(req.stdin).decode("ascii"),
        "args": req.args,
        "env": req.env,
        "files": files,
        "fetch_files": [_relative(p, "fetch_files") for p in req.fetch_files],
        "timeout_s": req.timeout_s,
        "compile_timeout_s": req.compile_timeout_s,
        "max_output_bytes": req.max_output_bytes,
    }
