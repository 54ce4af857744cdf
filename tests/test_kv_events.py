"""KV events: a subscriber written against vLLM's published schema rebuilds the store's cached
prefixes from the events alone (commits, LRU demotion to the host tier, eviction, drops, flush),
block hashes are stable values of the L2 key chain, and the ZMQ publisher frames and replays
batches as vLLM's does."""

import collections
import random
import time

import msgspec
import pytest

from radixkv import BlockPool, KVStore
from radixkv.events import EventLog, KVEventsConfig, TreeRecorder, start_publisher
from radixkv.events.wire import BatchEncoder
from radixkv.l2.block_keys import block_keys
from radixkv.store.tier import host_pool_for
from tests.test_store import BS, SPECS, kv_for

# -- the subscriber's side: vLLM's schema, written out here (nothing of radixkv.events) -------


def vllm_structs(array_like: bool):
    """vLLM's ``kv_events`` structs; ``array_like`` events are its first layout, maps its later one."""

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]
        medium: str | None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return msgspec.msgpack.Decoder(KVEventBatch), BlockStored, BlockRemoved


class Rebuilt:
    """What a router knows of one replica: per medium, block hash -> (parent hash, tokens)."""

    def __init__(self, array_like: bool = True) -> None:
        self.decoder, self._stored, self._removed = vllm_structs(array_like)
        self.blocks: dict[str, dict[int, tuple[int | None, tuple[int, ...]]]] = collections.defaultdict(dict)

    def apply(self, payload: bytes) -> None:
        batch = self.decoder.decode(payload)
        assert batch.data_parallel_rank == 0
        for event in batch.events:
            if isinstance(event, self._stored):
                assert len(event.token_ids) == len(event.block_hashes) * event.block_size
                media = self.blocks[event.medium]
                parent = event.parent_block_hash
                for i, h in enumerate(event.block_hashes):
                    assert h not in media, "stored twice without a removal"
                    media[h] = (
                        parent,
                        tuple(event.token_ids[i * event.block_size : (i + 1) * event.block_size]),
                    )
                    parent = h
            elif isinstance(event, self._removed):
                for h in event.block_hashes:
                    del self.blocks[event.medium][h]
            else:
                self.blocks.clear()

    def prefixes(self) -> collections.Counter:
        """(medium, hash, every token from the root through the block) for every block."""
        every = {h: v for media in self.blocks.values() for h, v in media.items()}
        out = collections.Counter()
        for medium, media in self.blocks.items():
            for h in media:
                tokens, at = [], h
                while at is not None:
                    parent, block = every[at]  # a parent announced before its child, never gone first
                    tokens[:0] = block
                    at = parent
                out[(medium, h, tuple(tokens))] += 1
        return out


# -- the store's side ---------------------------------------------------------------------

IDENTITY = b"model-identity-digest"
PRIVATE = "private"  # a namespace the namer keeps local


def namer(namespace):
    return None if namespace == PRIVATE else (IDENTITY, repr(namespace).encode())


def tree_prefixes(store: KVStore) -> collections.Counter:
    """What the tree holds, hashed from scratch over each whole path (no recorder memo)."""
    out = collections.Counter()
    for node in store.tree.iter_nodes():
        path, at = [], node
        while not at.is_root:
            path[:0] = at.tokens
            at = at.parent
        if at.key == PRIVATE:
            continue
        keys = block_keys(IDENTITY, repr(at.key).encode(), path, BS)
        first = len(path) // BS - len(node.block_ids)
        for i in range(first, len(keys)):
            medium = ("GPU", "CPU")[node.tier]
            out[(medium, int.from_bytes(keys[i][-8:], "big"), tuple(path[: (i + 1) * BS]))] += 1
    return out


def tiered_store(device_blocks=10, host_blocks=8) -> KVStore:
    device = BlockPool(SPECS, device_blocks, BS)
    return KVStore(device, host_pool_for(device, tokens=host_blocks * BS))


@pytest.mark.parametrize("layout", ["array", "map"])
def test_a_subscriber_rebuilds_the_trees_prefixes_from_the_events_alone(layout) -> None:
    rng = random.Random(42)
    store = tiered_store()
    log = EventLog()
    encoder = BatchEncoder(layout)
    rebuilt = Rebuilt(array_like=layout == "array")
    store.commit([1] * 9, *kv_for([1] * 9))  # cached before the listener: announced
    store.set_listener(TreeRecorder(log, BS, namer))
    heads = [[rng.randrange(4) for _ in range(rng.choice((4, 8)))] for _ in range(4)]
    seen = collections.Counter()
    for step in range(160):
        op = rng.random()
        ns = rng.choice(("a", "b", PRIVATE))
        if op < 0.02:
            store.flush()
        elif op < 0.05:
            store.drop(lambda key, ns=ns: key == ns)
        else:
            tokens = rng.choice(heads) + [rng.randrange(4) for _ in range(rng.randrange(0, 14))]
            if op < 0.3:
                with store.acquire(tokens, ns):  # recency only: moves the LRU order
                    pass
            else:
                store.commit(tokens, *kv_for(tokens), namespace=ns)
        events = log.take()
        seen.update(type(e).__name__ for e in events)
        if events:
            rebuilt.apply(encoder.encode(events, time.time(), 0))
        store.check_invariants()
        assert rebuilt.prefixes() == tree_prefixes(store), f"step {step}"
    # every kind of change happened: stores on both tiers, demotions, host drops, flushes
    assert seen["BlockStored"] and seen["BlockRemoved"] and seen["AllBlocksCleared"]
    stats = store.stats()
    assert stats["demoted_blocks"] and stats["evicted_blocks"], stats


def test_block_hashes_are_the_same_in_every_process_and_history() -> None:
    """Hashes depend on (identity, namespace key, tokens) only: a literal (no hash(), no
    process state) and equal whatever splits or order built the tree."""
    prefix = list(range(12))
    logs = []
    for history in ([prefix], [prefix[:4] + [9] * 4, prefix[:8] + [7], prefix]):
        store = tiered_store()
        logs.append(EventLog())
        store.set_listener(TreeRecorder(logs[-1], BS, namer))
        for tokens in history:
            store.commit(tokens, *kv_for(tokens), namespace="a")
        rebuilt = Rebuilt()
        rebuilt.apply(BatchEncoder().encode(logs[-1].take(), 0.0, 0))
        by_prefix = {p: h for (_, h, p) in rebuilt.prefixes()}
        assert by_prefix[tuple(prefix)] == 0x3DE3B3932137C580, hex(by_prefix[tuple(prefix)])


def test_the_publisher_frames_batches_like_vllm_and_replays_what_a_subscriber_missed(tmp_path) -> None:
    zmq = pytest.importorskip("zmq")
    config = KVEventsConfig.from_json(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "topic": "kv@replica-0",'
        f' "endpoint": "ipc://{tmp_path}/pub", "replay_endpoint": "ipc://{tmp_path}/replay",'
        ' "buffer_steps": 100}'
    )
    store, log = tiered_store(), EventLog()
    store.set_listener(TreeRecorder(log, BS, namer))
    publisher = start_publisher(config, log)
    ctx = zmq.Context()
    sub, replay = ctx.socket(zmq.SUB), ctx.socket(zmq.DEALER)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        sub.connect(config.endpoint)
        replay.connect(config.replay_endpoint)
        while not sub.poll(20):  # PUB drops what it sends before the SUB joins: announce until it has
            store.flush()
        received = {}
        rng = random.Random(7)
        for _ in range(40):
            tokens = [rng.randrange(3) for _ in range(rng.randrange(4, 20))]
            store.commit(tokens, *kv_for(tokens), namespace="a")
            time.sleep(0.002)  # let batches form: the test wants several
        while publisher.num_events < log.num_appended:  # sent everything logged
            time.sleep(0.01)
        while len(received) < publisher.num_batches:
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv@replica-0" and len(seq) == 8
            received[int.from_bytes(seq, "big")] = payload
        first = min(received)
        assert sorted(received) == list(range(first, publisher.num_batches)) and publisher.num_batches > 4
        # a subscriber that lost batches 2.. asks for them and gets them, then the end marker
        lost = first + 2
        replay.send_multipart([b"", lost.to_bytes(8, "big")])
        replayed = []
        while True:
            empty, seq, payload = replay.recv_multipart()
            assert empty == b""
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert payload == b""
                break
            replayed.append((int.from_bytes(seq, "big"), payload))
        assert replayed == [(s, received[s]) for s in range(lost, publisher.num_batches)]
        rebuilt = Rebuilt()
        for s in range(first, lost):
            rebuilt.apply(received[s])
        for _, payload in replayed:
            rebuilt.apply(payload)
        assert rebuilt.prefixes() == tree_prefixes(store)
    finally:
        sub.close(0)
        replay.close(0)
        ctx.term()
        publisher.close()


def test_the_config_takes_vllms_json_and_names_what_is_wrong() -> None:
    config = KVEventsConfig.from_json(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",'
        ' "topic": "kv", "replay_endpoint": "tcp://*:5558", "buffer_steps": 10000}'
    )
    assert config.enabled and config.replay_endpoint == "tcp://*:5558"
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": false}').enabled
    assert start_publisher(KVEventsConfig(), EventLog()) is None
    for text, words in [
        ('{"enable_kv_cache_event": true}', "enable_kv_cache_event"),
        ('{"publisher": "nats"}', "zmq, null"),
        ('{"buffer_steps": 0}', "buffer_steps"),
        ('{"event_layout": "json"}', "array, map"),
        ("[1]", "JSON object"),
    ]:
        with pytest.raises(ValueError, match=words):
            KVEventsConfig.from_json(text)


def test_the_sidecar_publishes_its_blocks_under_the_hashes_an_engine_gives_them() -> None:
    """One prefix, one key: the same hashes from an engine's store and from the sidecar's
    shared tier (medium CPU), so a router sees both holding the same blocks; evictions too."""
    from radixkv.events.recorder import sidecar_listener
    from radixkv.sidecar.state import Sidecar
    from radixkv.tree import pack_tokens

    log = EventLog()
    one = {"num_kv_heads": 1, "k_head_dim": 64, "v_head_dim": 64, "dtype": "float32"}
    sidecar = Sidecar(1024 * 6, tree_listener=sidecar_listener(log))  # 6 blocks of 2 tokens
    sidecar.add_client(1)
    sidecar.hello(1, {"block_size": 2, "layers": [one]})
    key = (b"\x01" * 32, b'{"str":"a"}')
    rebuilt = Rebuilt()
    for tokens in ([5, 6, 7, 8, 9], [5, 6, 1, 2], [3] * 8):  # the last evicts the LRU leaf
        txn = sidecar.alloc(1, key, bytes(pack_tokens(tokens)))
        sidecar.commit(1, txn["txn"])
        rebuilt.apply(BatchEncoder().encode(log.take(), 0.0, 0))
    held = {p: h for (medium, h, p) in rebuilt.prefixes() if medium == "CPU"}
    assert sorted(held) == [(3, 3), (3,) * 4, (3,) * 6, (3,) * 8, (5, 6), (5, 6, 1, 2)]

    engine, engine_log = BlockPool(SPECS, 8, 2), EventLog()
    store = KVStore(engine)
    store.set_listener(TreeRecorder(engine_log, 2, lambda ns: key))
    store.commit([5, 6, 1, 2, 4], *kv_for([5, 6, 1, 2, 4]))
    engine_rebuilt = Rebuilt()
    engine_rebuilt.apply(BatchEncoder().encode(engine_log.take(), 0.0, 0))
    on_gpu = {p: h for (medium, h, p) in engine_rebuilt.prefixes() if medium == "GPU"}
    assert on_gpu == {p: held[p] for p in [(5, 6), (5, 6, 1, 2)]}
