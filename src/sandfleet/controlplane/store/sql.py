"""The store on SQLAlchemy Core: SQLite by default, any SQLAlchemy URL works.

Each record is kept as its wire model's JSON beside the few columns queries
filter on, so adding a field needs no migration.
"""

from __future__ import annotations

import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from sandfleet.wire.models import NodeInfo, SandboxInfo, SandboxState

__all__ = ["SqlStore"]

_meta = sa.MetaData()
_nodes = sa.Table(
    "nodes",
    _meta,
    sa.Column("node_id", sa.String(64), primary_key=True),
    sa.Column("doc", sa.Text, nullable=False),
)
_sandboxes = sa.Table(
    "sandboxes",
    _meta,
    sa.Column("id", sa.String(80), primary_key=True),
    sa.Column("node_id", sa.String(64), nullable=False, index=True),
    sa.Column("state", sa.String(16), nullable=False, index=True),
    sa.Column("expires_at", sa.Float, nullable=True, index=True),
    sa.Column("doc", sa.Text, nullable=False),
)


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA busy_timeout=5000")
    cur.close()


class SqlStore:
    """A :class:`~sandfleet.controlplane.store.base.Store` on an SQLAlchemy URL.

    ``url`` is e.g. ``sqlite:////var/lib/sandfleet/state.db`` or
    ``postgresql+psycopg://user@host/db``.
    """

    def __init__(self, url: str) -> None:
        self._engine: Engine = sa.create_engine(url, future=True)
        if self._engine.dialect.name == "sqlite":
            sa.event.listen(self._engine, "connect", _sqlite_pragmas)
        _meta.create_all(self._engine)

    # nodes
    def put_node(self, node: NodeInfo) -> None:
        with self._engine.begin() as c:
            c.execute(sa.delete(_nodes).where(_nodes.c.node_id == node.node_id))
            c.execute(sa.insert(_nodes).values(node_id=node.node_id, doc=node.model_dump_json()))

    def patch_node(self, node_id: str, fields: dict[str, Any]) -> NodeInfo | None:
        with self._engine.begin() as c:
            row = c.execute(sa.select(_nodes.c.doc).where(_nodes.c.node_id == node_id)).first()
            if row is None:
                return None
            node = NodeInfo.model_validate_json(row[0]).model_copy(update=fields)
            c.execute(
                sa.update(_nodes)
                .where(_nodes.c.node_id == node_id)
                .values(doc=node.model_dump_json())
            )
        return node

    def get_node(self, node_id: str) -> NodeInfo | None:
        with self._engine.connect() as c:
            row = c.execute(sa.select(_nodes.c.doc).where(_nodes.c.node_id == node_id)).first()
        return NodeInfo.model_validate_json(row[0]) if row else None

    def list_nodes(self) -> list[NodeInfo]:
        with self._engine.connect() as c:
            rows = c.execute(sa.select(_nodes.c.doc).order_by(_nodes.c.node_id)).all()
        return [NodeInfo.model_validate_json(r[0]) for r in rows]

    # sandboxes
    def put_sandbox(self, sandbox: SandboxInfo) -> None:
        values = {
            "node_id": sandbox.node_id,
            "state": sandbox.state,
            "expires_at": sandbox.expires_at,
            "doc": sandbox.model_dump_json(),
        }
        with self._engine.begin() as c:
            res = c.execute(
                sa.update(_sandboxes).where(_sandboxes.c.id == sandbox.id).values(**values)
            )
            if res.rowcount == 0:
                c.execute(sa.insert(_sandboxes).values(id=sandbox.id, **values))

    def get_sandbox(self, sandbox_id: str) -> SandboxInfo | None:
        with self._engine.connect() as c:
            row = c.execute(
                sa.select(_sandboxes.c.doc).where(_sandboxes.c.id == sandbox_id)
            ).first()
        return SandboxInfo.model_validate_json(row[0]) if row else None

    def set_sandbox_state(
        self, sandbox_id: str, state: SandboxState, ended: str | None = None
    ) -> None:
        current = self.get_sandbox(sandbox_id)
        if current is not None:
            update: dict[str, object] = {"state": state}
            if ended is not None:
                update |= {"ended": ended, "ended_at": time.time()}
            self.put_sandbox(current.model_copy(update=update))

    def delete_sandbox(self, sandbox_id: str) -> None:
        with self._engine.begin() as c:
            c.execute(sa.delete(_sandboxes).where(_sandboxes.c.id == sandbox_id))

    def list_sandboxes(
        self,
        *,
        labels: dict[str, str] | None = None,
        node_id: str | None = None,
        states: tuple[SandboxState, ...] = ("creating", "running", "paused"),
    ) -> list[SandboxInfo]:
        q = sa.select(_sandboxes.c.doc).where(_sandboxes.c.state.in_(states))
        if node_id is not None:
            q = q.where(_sandboxes.c.node_id == node_id)
        with self._engine.connect() as c:
            rows = c.execute(q.order_by(_sandboxes.c.id)).all()
        found = [SandboxInfo.model_validate_json(r[0]) for r in rows]
        if labels:
            found = [s for s in found if all(s.labels.get(k) == v for k, v in labels.items())]
        return found

    def expired_sandboxes(self, now: float) -> list[SandboxInfo]:
        q = sa.select(_sandboxes.c.doc).where(
            _sandboxes.c.state.in_(("creating", "running", "paused")),
            _sandboxes.c.expires_at.is_not(None),
            _sandboxes.c.expires_at < now,
        )
        with self._engine.connect() as c:
            return [SandboxInfo.model_validate_json(r[0]) for r in c.execute(q).all()]

    def close(self) -> None:
        self._engine.dispose()
