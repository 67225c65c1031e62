"""The SQLite store, sandbox ids and the error wire format."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from sandfleet.controlplane.ids import new_sandbox_id, node_of, validate_node_id
from sandfleet.controlplane.store import SqlStore
from sandfleet.wire import errors
from sandfleet.wire.models import ExecResult, NodeCapacity, NodeInfo, SandboxInfo


def sandbox(i: int, **kw: object) -> SandboxInfo:
    args: dict[str, object] = dict(
        id=new_sandbox_id("n1"),
        kind="container",
        node_id="n1",
        state="running",
        image="img:1",
        cpu=1.0,
        memory_mb=256,
        pids_limit=64,
        labels={"job": f"j{i % 2}"},
    )
    args.update(kw)
    return SandboxInfo(**args)  # type: ignore[arg-type]


def test_store_round_trip_labels_and_ttl(tmp_path: Path) -> None:
    store = SqlStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    boxes = [sandbox(i, expires_at=time.time() - 1 if i == 0 else None) for i in range(4)]
    for b in boxes:
        store.put_sandbox(b)
    assert store.get_sandbox(boxes[1].id) == boxes[1]
    assert {b.id for b in store.list_sandboxes(labels={"job": "j0"})} == {boxes[0].id, boxes[2].id}
    assert [b.id for b in store.expired_sandboxes(time.time())] == [boxes[0].id]
    store.set_sandbox_state(boxes[0].id, "destroyed")
    assert boxes[0].id not in {b.id for b in store.list_sandboxes()}
    store.put_node(
        NodeInfo(
            node_id="n1",
            address="http://x",
            kinds=["container"],
            capacity=NodeCapacity(max_sandboxes=1, cpu=1, memory_mb=1),
        )
    )
    store.close()
    reopened = SqlStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    assert reopened.get_node("n1") is not None
    assert reopened.get_sandbox(boxes[3].id) == boxes[3]
    reopened.close()


def test_sandbox_ids_name_their_node() -> None:
    sid = new_sandbox_id("node-7")
    assert node_of(sid) == "node-7"
    with pytest.raises(errors.InvalidArgument, match="not a sandbox id"):
        node_of("nope")
    with pytest.raises(errors.InvalidArgument, match="a-z, 0-9"):
        validate_node_id("Bad_Node")


def test_errors_cross_the_wire_by_code() -> None:
    for cls in (
        errors.NotFound,
        errors.InvalidArgument,
        errors.ResourceExhausted,
        errors.FailedPrecondition,
        errors.Unavailable,
        errors.DeadlineExceeded,
        errors.PermissionDenied,
    ):
        exc = cls("what to change")
        back = errors.error_from_wire(exc.to_wire(), exc.http_status)
        assert type(back) is cls and back.message == "what to change"
    assert errors.ResourceExhausted.retryable and not errors.InvalidArgument.retryable
    assert isinstance(errors.DeadlineExceeded("x"), TimeoutError)
    assert isinstance(errors.error_from_wire("garbage", 502), errors.Internal)


def test_exec_result_bytes_are_exact_over_json() -> None:
    r = ExecResult(status="exited", exit_code=0, stdout=b"\xe2", stderr=b"a\0b\0")
    back = ExecResult.model_validate_json(r.model_dump_json())
    assert back.stdout == b"\xe2" and back.stderr == b"a\0b\0"
    assert back.stdout_text == "\ufffd"
