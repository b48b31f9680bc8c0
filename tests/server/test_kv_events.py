"""The KV events a worker publishes for vllm-router, read back with a ZMQ subscriber: vLLM's
framing, every key of each event, blocks shared between entries announced once and removed when
the last entry holding them goes, and the prefix a router can credit a prompt with."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

zmq = pytest.importorskip("zmq", reason="the [cluster] extra (pyzmq) is not installed")
msgpack = pytest.importorskip("msgpack", reason="the [cluster] extra (msgpack) is not installed")

from hybridkv.server.kv_events import BLOCK_SIZE, KvEvents, block_hashes  # noqa: E402
from hybridkv.server.replicas import free_port  # noqa: E402

STORED_KEYS = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"}


@pytest.fixture
def events() -> Iterator[tuple[KvEvents, Any]]:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    publisher = KvEvents(endpoint)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(endpoint)
    time.sleep(0.3)  # ZMQ's slow joiner: what is published before the subscription lands is dropped
    # ... or not: the publisher's opening AllBlocksCleared arrives when the subscription was quick.
    while sub.poll(0):
        assert _batch(sub)[1] == [{"type": "AllBlocksCleared"}]
    yield publisher, sub
    sub.close()
    context.term()
    publisher.close()


def _batch(sub: Any) -> tuple[int, list[dict[str, Any]]]:
    topic, seq, payload = sub.recv_multipart()
    assert topic == b"" and len(seq) == 8
    timestamp, batch, rank = msgpack.unpackb(payload)
    assert isinstance(timestamp, float) and rank is None
    return int.from_bytes(seq, "big"), batch


def test_blocks_are_stored_once_and_removed_with_their_last_entry(events: tuple[KvEvents, Any]) -> None:
    publisher, sub = events
    a = list(range(100, 140))  # 2 full blocks and 8 tokens
    b = a[:20] + list(range(500, 516))  # shares a's first block only: 2 full blocks
    publisher.on_index("insert", a)
    publisher.on_index("insert", b)
    publisher.on_index("remove", a)
    seqs, batches = zip(*(_batch(sub) for _ in range(3)), strict=True)
    assert list(seqs) == sorted(seqs) and len(set(seqs)) == 3
    [stored_a], [stored_b], [removed] = batches
    ha, hb = block_hashes(a), block_hashes(b)
    assert set(stored_a) == STORED_KEYS and stored_a["type"] == "BlockStored"
    assert stored_a["block_hashes"] == ha and stored_a["parent_block_hash"] is None
    assert stored_a["token_ids"] == a[: 2 * BLOCK_SIZE] and stored_a["block_size"] == BLOCK_SIZE
    assert hb[0] == ha[0] and hb[1] != ha[1]
    assert stored_b["block_hashes"] == [hb[1]] and stored_b["parent_block_hash"] == ha[0]
    assert stored_b["token_ids"] == b[BLOCK_SIZE : 2 * BLOCK_SIZE]
    assert removed == {"type": "BlockRemoved", "block_hashes": [ha[1]], "medium": "GPU"}
    assert publisher.announced(a + [1, 2, 3]) == BLOCK_SIZE  # a's second block is gone, b keeps the first
    assert publisher.announced(b + [7] * 20) == 2 * BLOCK_SIZE
    assert publisher.announced(list(range(900, 950))) == 0


def test_a_fresh_publisher_starts_by_clearing() -> None:
    """The first batch of every process says AllBlocksCleared, at seq 0 (the router reads a lower
    seq as a restarted source): a late subscriber misses it, so the test binds a subscriber first."""
    port = free_port()
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(f"tcp://127.0.0.1:{port}")
    publisher = KvEvents(f"tcp://127.0.0.1:{port}")
    try:
        time.sleep(0.3)
        publisher.on_index("insert", list(range(16)))
        seq, batch = _batch(sub)
        if batch[0]["type"] == "AllBlocksCleared":  # not dropped by the slow joiner this time
            assert seq == 0 and batch == [{"type": "AllBlocksCleared"}]
            seq, batch = _batch(sub)
        assert batch[0]["type"] == "BlockStored"
    finally:
        sub.close()
        context.term()
        publisher.close()


def test_a_busy_endpoint_is_one_clear_error(events: tuple[KvEvents, Any]) -> None:
    with pytest.raises(OSError, match="--kv-events"):
        KvEvents(events[0].endpoint)
