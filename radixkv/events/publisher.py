"""The ZMQ publisher of KV events, as vLLM's ``ZmqEventPublisher`` puts them on the wire.

- PUB socket: each batch is one multipart message ``(topic, seq, payload)``: the topic as
  UTF-8, ``seq`` the batch's sequence number (from 0, 8 bytes big-endian), ``payload`` one
  msgpack ``KVEventBatch`` (``radixkv.events.wire``).
- Replay (``replay_endpoint``): a ROUTER socket. A request ``(identity, b"", start_seq)`` (a
  REQ or DEALER client sending the 8-byte big-endian start) is answered with ``(identity, b"",
  seq, payload)`` for every buffered batch with ``seq >= start_seq``, oldest first, then
  ``(identity, b"", -1 as 8 signed big-endian bytes, b"")``. The last ``buffer_steps`` batches
  are kept.

One thread owns both sockets. It waits on the ``EventLog``'s wake flag (at most 50 ms, to
answer replay requests), takes every event logged since its last batch, and sends them as one
batch: a batch is what changed between two wake-ups, as vLLM's is what one engine step changed.
pyzmq is needed only here (the ``events`` extra); ``start_publisher`` names it when missing.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

from radixkv.events.config import KVEventsConfig
from radixkv.events.recorder import EventLog
from radixkv.events.wire import BatchEncoder

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.05


def _binds(endpoint: str) -> bool:
    """vLLM's rule: wildcard, IPv6 any, ipc and inproc endpoints are bound, others connected."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """Publishes what ``log`` collects per ``config`` until ``close()``; ``rank`` is the
    batches' ``data_parallel_rank``. Raises zmq.ZMQError (the socket cannot bind or connect)."""

    def __init__(self, config: KVEventsConfig, log: EventLog, *, rank: int = 0) -> None:
        import zmq

        self._zmq = zmq
        self.config = config
        self.log = log
        self.rank = rank
        self.num_batches = 0  # sent so far (the next batch's seq)
        self.num_events = 0
        self._topic = config.topic.encode("utf-8")
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=config.buffer_steps)
        self._encoder = BatchEncoder(config.event_layout)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.set_hwm(config.hwm)
            if _binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="radixkv-kv-events", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        """Send what is logged, stop the thread, close the sockets (waiting up to ``timeout``
        for queued messages to leave)."""
        self._closing = True
        self.log.wake.set()
        self._thread.join(timeout)
        self._close_sockets(linger_ms=int(timeout * 1000))

    def _close_sockets(self, linger_ms: int = 0) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=linger_ms)
        self._ctx.term()

    def _run(self) -> None:
        while True:
            closing = self._closing
            self.log.wake.wait(_POLL_S)
            try:
                while self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                events = self.log.take()
                if events:
                    self._send(events)
            except Exception:  # a fault here must not stop later batches; the log says which
                logger.exception("KV events: publishing failed")
            if closing:
                return

    def _send(self, events: list) -> None:
        payload = self._encoder.encode(events, time.time(), self.rank)
        seq = self.num_batches.to_bytes(8, "big")
        self._pub.send_multipart((self._topic, seq, payload))
        self._buffer.append((self.num_batches, payload))
        self.num_batches += 1
        self.num_events += len(events)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV events: replay request of %d frames ignored (3 expected)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


def start_publisher(config: KVEventsConfig, log: EventLog, *, rank: int = 0) -> ZmqEventPublisher | None:
    """The publisher ``config`` asks for (None when events are off). Raises ValueError with a
    message for the user when pyzmq is missing or a socket cannot bind or connect."""
    if not config.enabled:
        return None
    try:
        import zmq
    except ImportError:
        raise ValueError(
            "KV events need pyzmq: pip install 'radixkv[events]' (or pip install 'pyzmq>=27,<28')"
        ) from None
    try:
        return ZmqEventPublisher(config, log, rank=rank)
    except zmq.ZMQError as e:
        raise ValueError(f"cannot open {config.endpoint} / {config.replay_endpoint}: {e}") from None
