"""KV cache events for vllm-router's `kv_aware` policy: what this worker's prefix cache holds,
published on a ZMQ PUB socket in vLLM's format, so the router sends a prompt where it is cached.

Wire format (vLLM's `ZmqEventPublisher`; the router connects, this side binds):

    multipart [b"" (topic), seq (8 bytes, big-endian), msgpack [timestamp, [event, ...], None]]
    BlockStored      {block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name}
    BlockRemoved     {block_hashes, medium}
    AllBlocksCleared {}

Each event is a map tagged by "type", every key present. A block is `BLOCK_SIZE` tokens; its hash
chains its parent's hash and its tokens (the router matches the tokens; a hash only names a block).
`seq` starts at 0 with every process, so a restarted worker reads to the router as a new source.

What is announced: for every entry of the prefix index (`PrefixIndex`), its full blocks up to its
end. An entry restores exactly there (its live state); a prompt that leaves it earlier restores at
the entry's newest snapshot at or before that point, which can be short of what the router credited
(a partial block is never announced, so a prompt extending an entry is credited up to 15 tokens
less than it gets). Blocks shared by several entries are counted, and removed when the last entry
holding them is evicted. `announced(ids)` is the prefix the router can credit for a prompt, shown per
request beside `cached_tokens`, so over-credit is visible.
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from array import array
from typing import Any

BLOCK_SIZE = 16
# "GPU" is vLLM's tier for blocks a worker computes from directly; the lower tiers (CPU, disk) are
# discounted by the router as needing a transfer first. Our blocks are in the worker's own memory.
MEDIUM = "GPU"
_ROOT = 0


def block_hashes(ids: list[int], block_size: int = BLOCK_SIZE) -> list[int]:
    """The chained hash of each full block of `ids` (63-bit, so any msgpack reader takes it)."""
    hashes, parent = [], _ROOT
    for start in range(0, len(ids) - block_size + 1, block_size):
        data = parent.to_bytes(8, "big") + array("q", ids[start : start + block_size]).tobytes()
        parent = int.from_bytes(hashlib.sha256(data).digest()[:8], "big") >> 1
        hashes.append(parent)
    return hashes


class KvEvents:
    """The blocks this worker announced (with how many index entries hold each) and the publisher.

    `on_index(change, tokens)` is a `PrefixIndex` listener: it runs in the engine thread and only
    queues; a thread of its own owns the socket. `announced` may be called from any thread."""

    def __init__(self, endpoint: str, block_size: int = BLOCK_SIZE) -> None:
        import zmq  # the [cluster] extra

        self.endpoint = endpoint
        self.block_size = block_size
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as e:
            self._socket.close()
            self._context.term()
            raise OSError(f"--kv-events {endpoint}: cannot bind it: {e}") from None
        self._held: dict[int, int] = {}  # block hash -> index entries holding it
        self._lock = threading.Lock()
        self._outbox: queue.Queue[list[dict[str, Any]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._publish, name="kv-events", daemon=True)
        self._thread.start()
        self._outbox.put([{"type": "AllBlocksCleared"}])  # whatever a router knew of this port is gone

    def on_index(self, change: str, tokens: list[int]) -> None:
        hashes = block_hashes(tokens, self.block_size)
        with self._lock:
            if change == "insert":
                first_new = next((i for i, h in enumerate(hashes) if h not in self._held), len(hashes))
                for h in hashes:
                    self._held[h] = self._held.get(h, 0) + 1
                events = [self._stored(hashes, tokens, first_new)] if first_new < len(hashes) else []
            else:
                gone = []
                for h in hashes:
                    self._held[h] -= 1
                    if self._held[h] == 0:
                        del self._held[h]
                        gone.append(h)
                events = [{"type": "BlockRemoved", "block_hashes": gone, "medium": MEDIUM}] if gone else []
        if events:
            self._outbox.put(events)

    def _stored(self, hashes: list[int], tokens: list[int], first: int) -> dict[str, Any]:
        size = self.block_size
        return {
            "type": "BlockStored",
            "block_hashes": hashes[first:],
            "parent_block_hash": hashes[first - 1] if first > 0 else None,
            "token_ids": tokens[first * size : len(hashes) * size],
            "block_size": size,
            "lora_id": None,
            "medium": MEDIUM,
            "lora_name": None,
        }

    def announced(self, ids: list[int]) -> int:
        """Tokens of `ids` covered by announced blocks: the prefix the router credits it with."""
        with self._lock:
            covered = 0
            for h in block_hashes(ids, self.block_size):
                if h not in self._held:
                    break
                covered += self.block_size
        return covered

    def close(self) -> None:
        self._outbox.put(None)
        self._thread.join(timeout=5)
        self._context.term()

    def _publish(self) -> None:
        import msgpack

        seq = 0
        while (events := self._outbox.get()) is not None:
            batch = msgpack.packb([time.time(), events, None])
            self._socket.send_multipart([b"", seq.to_bytes(8, "big"), batch])
            seq += 1
        self._socket.close()
