"""A KV-aware router: it routes each request to the replica whose cache holds most of its prompt,
as each replica's KV events say (docs/kv-events.md), not as the router guesses.

    python -m demo --port 8001 --kv-events-config '{"enable_kv_cache_events": true,
        "endpoint": "ipc:///tmp/r0.pub", "replay_endpoint": "ipc:///tmp/r0.replay"}'
    python -m demo --port 8002 --kv-events-config '{... "/tmp/r1.pub" ... "/tmp/r1.replay"}'
    python examples/kv_router.py --port 8000 --tokenizer builtin-tiny \\
        --replica http://127.0.0.1:8001=ipc:///tmp/r0.pub,ipc:///tmp/r0.replay \\
        --replica http://127.0.0.1:8002=ipc:///tmp/r1.pub,ipc:///tmp/r1.replay

It is what llm-d's KV-cache manager and NVIDIA Dynamo's KV router do with vLLM's events, in one
file, written against vLLM's published event schema only (it imports nothing of radixkv's):

- **Index.** Per replica, a SUB socket reads ``(topic, seq, EventBatch)`` messages. A
  ``BlockStored`` gives block hashes, their parent's hash and the blocks' token ids; the router
  keys each block by its own chained hash over the token ids (``hash((parent's own hash, the
  block's tokens))``), so it needs no knowledge of how the engine hashes, and two replicas that
  hold the same tokens agree. ``BlockRemoved`` and ``AllBlocksCleared`` take blocks out. A gap in
  ``seq`` (a restart of the router, a slow subscriber) is filled from the replica's replay socket;
  at start the router replays everything the replica kept.
- **Routing.** The router tokenizes a request as the server will (the checkpoint's tokenizer and
  chat template, ``--tokenizer``), cuts it into blocks of the replica's block size and counts, per
  replica, the leading blocks it holds (device or host tier). The replica with the most wins;
  with no match anywhere, the one holding the fewest blocks (most room: what SGLang's
  cache-aware policy does), then the one with the fewest requests in flight. A replica more
  than ``--balance`` requests busier than the least busy one is passed over.
- **Proxy.** ``POST /v1/chat/completions`` and ``/v1/completions`` go to the chosen replica,
  streamed through; the reply carries ``x-kv-router-replica`` (its index). Other paths go to
  replica 0. ``GET /kv_router/state`` shows what the router knows.

Not covered: a tenant's or an adapter's namespace (events carry the adapter's ``lora_name``,
which is part of the key here, but no tenant), image prompts (their placeholder tokens are
keyed by content the router cannot see), and several routers sharing one index.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import requests
import zmq

log = logging.getLogger("kv_router")


# -- vLLM's event schema (vllm/distributed/kv_events.py), the array layout -------------------
class BlockStored(msgspec.Struct, array_like=True, tag=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class BlockRemoved(msgspec.Struct, array_like=True, tag=True):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, array_like=True, tag=True):
    pass


class KVEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_END = (-1).to_bytes(8, "big", signed=True)


def chain(parent: int | None, tokens, lora: str | None) -> int:
    """The router's own hash of a block: its parent's and its tokens (and the adapter's name)."""
    return hash((parent, tuple(tokens), lora))


class ReplicaIndex:
    """What one replica's cache holds, as its events said: the router's hash of every block."""

    def __init__(self) -> None:
        self.block_size: int | None = None
        self.by_engine: dict[int, tuple[int, set[str]]] = {}  # engine hash -> (own hash, media)
        self.held: collections.Counter[int] = collections.Counter()  # own hash -> engine blocks
        self.seq = -1  # the last batch applied

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.block_size = event.block_size
                bs, medium = event.block_size, event.medium or "GPU"
                known = (
                    self.by_engine.get(event.parent_block_hash)
                    if event.parent_block_hash is not None
                    else None
                )
                parent = known[0] if known is not None else None
                for i, engine_hash in enumerate(event.block_hashes):
                    own = chain(parent, event.token_ids[i * bs : (i + 1) * bs], event.lora_name)
                    entry = self.by_engine.get(engine_hash)
                    if entry is None:
                        entry = self.by_engine[engine_hash] = (own, set())
                        self.held[own] += 1
                    entry[1].add(medium)
                    parent = own
            elif isinstance(event, BlockRemoved):
                medium = event.medium or "GPU"
                for engine_hash in event.block_hashes:
                    entry = self.by_engine.get(engine_hash)
                    if entry is None:
                        continue
                    entry[1].discard(medium)
                    if not entry[1]:
                        del self.by_engine[engine_hash]
                        self.held[entry[0]] -= 1
                        if not self.held[entry[0]]:
                            del self.held[entry[0]]
            else:
                self.by_engine.clear()
                self.held.clear()

    def matched_blocks(self, tokens: list[int], lora: str | None = None) -> int:
        """Leading whole blocks of ``tokens`` this replica holds."""
        bs = self.block_size
        if not bs:
            return 0
        parent, n = None, 0
        for start in range(0, len(tokens) - bs + 1, bs):
            parent = chain(parent, tokens[start : start + bs], lora)
            if parent not in self.held:
                break
            n += 1
        return n


class Subscriber(threading.Thread):
    """Reads every replica's events into its index (one thread, one poller)."""

    def __init__(self, replicas: list[Replica], lock: threading.Lock) -> None:
        super().__init__(name="kv-events", daemon=True)
        self.replicas, self.lock = replicas, lock
        self.ctx = zmq.Context.instance()
        self.ready = threading.Event()

    def _replay(self, replica: Replica, start: int) -> None:
        if not replica.replay:
            return
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVTIMEO, 10_000)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(replica.replay)
        try:
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                _, seq, payload = sock.recv_multipart()
                if seq == _END:
                    return
                self._apply(replica, int.from_bytes(seq, "big"), payload)
        except zmq.Again:
            log.warning("replica %s: no answer from its replay socket", replica.url)
        finally:
            sock.close()

    def _apply(self, replica: Replica, seq: int, payload: bytes) -> None:
        if seq <= replica.index.seq:
            return  # seen already (a replay overlapping live batches)
        with self.lock:
            replica.index.apply(_decoder.decode(payload))
            replica.index.seq = seq

    def run(self) -> None:
        poller = zmq.Poller()
        socks = {}
        for replica in self.replicas:
            sub = self.ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(replica.events)
            poller.register(sub, zmq.POLLIN)
            socks[sub] = replica
        for replica in self.replicas:  # what each replica held before the router started
            self._replay(replica, 0)
        self.ready.set()
        while True:
            for sub, _ in poller.poll():
                _topic, seq_bytes, payload = sub.recv_multipart()
                replica, seq = socks[sub], int.from_bytes(seq_bytes, "big")
                if seq > replica.index.seq + 1:  # missed batches: ask the replay socket
                    self._replay(replica, replica.index.seq + 1)
                self._apply(replica, seq, payload)


class Replica:
    def __init__(self, spec: str) -> None:
        url, _, sockets = spec.partition("=")
        events, _, replay = sockets.partition(",")
        if not url.startswith("http") or not events:
            raise SystemExit(f"--replica {spec!r}: expected URL=EVENTS_ENDPOINT[,REPLAY_ENDPOINT]")
        self.url, self.events, self.replay = url.rstrip("/"), events, replay or None
        self.index = ReplicaIndex()
        self.in_flight = 0


def load_tokenizer(name: str):
    """The checkpoint's tokenizer and the chat template the demo server renders with."""
    if name.startswith("builtin"):
        from demo.model.loading import build_builtin

        tokenizer = build_builtin(name)[1]
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(name)
    return tokenizer


def prompt_tokens(tokenizer, path: str, body: dict) -> list[int] | None:
    """The prompt's token ids as the server will compute them, or None (route by load)."""
    try:
        if path.endswith("/chat/completions"):
            from demo.model import chat_tokens
            from demo.model.loading import CHAT_TEMPLATE

            messages = []
            for m in body["messages"]:
                content = m.get("content")
                if isinstance(content, list):  # text parts only: an image makes it unroutable
                    if any(p.get("type") != "text" for p in content):
                        return None
                    content = "".join(p["text"] for p in content)
                messages.append({**m, "content": content})
            template = None if getattr(tokenizer, "chat_template", None) else CHAT_TEMPLATE
            return chat_tokens.chat_ids(tokenizer, messages, template, body.get("tools"))
        prompt = body["prompt"]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        return tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else None
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


class Router:
    def __init__(self, replicas: list[Replica], tokenizer, balance: int, adapters=()) -> None:
        self.replicas, self.tokenizer, self.balance = replicas, tokenizer, balance
        self.adapters = set(adapters)  # model names that are adapters (their blocks carry lora_name)
        self.lock = threading.Lock()
        self.routed = collections.Counter()

    def choose(self, tokens: list[int] | None, lora: str | None) -> int:
        with self.lock:
            least_busy = min(r.in_flight for r in self.replicas)

            def rank(i: int):
                r = self.replicas[i]
                matched = r.index.matched_blocks(tokens, lora) * (r.index.block_size or 0) if tokens else 0
                return (-matched, len(r.index.by_engine), r.in_flight, i)

            eligible = [i for i, r in enumerate(self.replicas) if r.in_flight <= least_busy + self.balance]
            chosen = min(eligible, key=rank)
            self.replicas[chosen].in_flight += 1
            self.routed[chosen] += 1
            return chosen

    def done(self, i: int) -> None:
        with self.lock:
            self.replicas[i].in_flight -= 1

    def state(self) -> dict:
        with self.lock:
            return {
                "replicas": [
                    {
                        "url": r.url,
                        "blocks": len(r.index.by_engine),
                        "block_size": r.index.block_size,
                        "seq": r.index.seq,
                        "in_flight": r.in_flight,
                        "routed": self.routed[i],
                    }
                    for i, r in enumerate(self.replicas)
                ]
            }


def handler_for(router: Router):
    session = requests.Session()
    hop = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):
            log.debug(fmt, *args)

        def _relay(self, replica: int, method: str, body: bytes | None) -> None:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in hop}
            url = router.replicas[replica].url + self.path
            try:
                upstream = session.request(method, url, data=body, headers=headers, stream=True, timeout=600)
            except requests.RequestException as e:
                return self._json(
                    502, {"error": {"message": f"replica {replica} ({url}): {e}", "type": "bad_gateway"}}
                )
            with upstream:
                self.send_response(upstream.status_code)
                for k, v in upstream.headers.items():
                    if k.lower() not in hop:
                        self.send_header(k, v)
                self.send_header("x-kv-router-replica", str(replica))
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for chunk in upstream.iter_content(chunk_size=None):
                    if chunk:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")

        def _json(self, status: int, obj) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/kv_router/state":
                return self._json(200, router.state())
            return self._relay(0, "GET", None)

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if not self.path.endswith(("/chat/completions", "/completions")):
                return self._relay(0, "POST", body)
            try:
                data = json.loads(body)
            except ValueError:
                data = None
            tokens = prompt_tokens(router.tokenizer, self.path, data) if isinstance(data, dict) else None
            lora = data.get("model") if isinstance(data, dict) else None
            lora = lora if isinstance(lora, str) and lora in router.adapters else None
            chosen = router.choose(tokens, lora)
            try:
                self._relay(chosen, "POST", body)
            finally:
                router.done(chosen)

    return Handler


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replica", action="append", required=True, help="URL=EVENTS_ENDPOINT[,REPLAY_ENDPOINT]")
    p.add_argument(
        "--tokenizer", required=True, help="the replicas' checkpoint (a path, a Hub id, builtin-tiny)"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port")
    p.add_argument(
        "--balance",
        type=int,
        default=8,
        help="requests in flight above the least busy replica's that rule a replica out",
    )
    p.add_argument(
        "--adapter",
        action="append",
        default=[],
        help="a model name the replicas serve as an adapter (keyed as its lora_name)",
    )
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s kv_router %(message)s")
    replicas = [Replica(spec) for spec in args.replica]
    router = Router(replicas, load_tokenizer(args.tokenizer), args.balance, args.adapter)
    subscriber = Subscriber(replicas, router.lock)
    subscriber.start()
    subscriber.ready.wait(60)
    server = ThreadingHTTPServer((args.host, args.port), handler_for(router))
    server.daemon_threads = True
    print(f"kv_router serving on http://{args.host}:{server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
