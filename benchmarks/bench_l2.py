"""The shared tier's block throughput through radixkv.l2 vs ``redis-benchmark`` (issue 26, bench 4).

Run by hand (never a timed test)::

    python -m benchmarks.bench_l2                          # 64 KiB, 512 KiB, 2 MiB blocks
    python -m benchmarks.bench_l2 --sizes 2097152 --batches 1 8 --rounds 9

Starts its own redis-server on a free loopback port (no persistence) and, for each block size
and batch size B, measures in the same run and against the same server:

- ``redis-benchmark -t set,get -d SIZE -n N -c 1 -P B``: one connection, B requests per round
  trip (C client, the ceiling for one connection);
- radixkv.l2: ``put_many`` / ``get_many`` of B blocks per call from one thread over 32 distinct
  keys (each value is SIZE bytes of payload plus the 80-byte header; reads verify the checksum
  and identity of every value).

- plain redis-py pipelines of the same GET/SET (no header, no checksum): what the client
  library costs by itself, apart from what radixkv.l2 adds.

Prints the median requests/s of ``--rounds`` rounds (the sides run one after the other in each
round, so a noisy neighbour hits all of them), radixkv.l2's MB/s, and its ratio to
redis-benchmark (issue 26's target: >= 0.7x).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time

from radixkv.l2 import block_keys, open_l2
from tests.redis_server import RedisServer


def redis_benchmark(port: int, size: int, n: int, pipeline: int) -> dict[str, float]:
    """Requests/s of SET and GET from redis-benchmark's CSV output."""
    out = subprocess.run(
        ["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-t", "set,get", "-d", str(size), "-n", str(n),
         "-c", "1", "-P", str(pipeline), "--csv"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    rps = {}
    for line in out.splitlines():
        cells = [c.strip('"') for c in line.split(",")]
        if cells[0] in ("SET", "GET"):
            rps[cells[0]] = float(cells[1])
    return rps


def ours(url: str, size: int, n: int, batch: int) -> dict[str, float]:
    """Blocks/s of put_many and get_many, ``batch`` blocks per call, one thread."""
    store = open_l2(url, identity=b"bench", timeout_s=5.0)
    keys = block_keys(b"bench", b"", list(range(32 * 16)), 16)
    payload = os.urandom(size)
    calls = max(1, n // batch)
    groups = [[keys[(c * batch + i) % len(keys)] for i in range(batch)] for c in range(calls)]
    start = time.perf_counter()
    for group in groups:
        if store.put_many([(k, payload) for k in group]) != batch:
            raise RuntimeError(f"put_many stored fewer than {batch}: {store.stats()}")
    put_s = time.perf_counter() - start
    start = time.perf_counter()
    for group in groups:
        got = store.get_many(group)
        if any(g is None or g.nbytes != size for g in got):
            raise RuntimeError(f"get_many missed: {store.stats()}")
    get_s = time.perf_counter() - start
    store.close()
    return {"SET": calls * batch / put_s, "GET": calls * batch / get_s}


def plain_redis_py(port: int, size: int, n: int, batch: int) -> dict[str, float]:
    """The same loop through plain redis-py pipelines (no header, no checksum): what the client
    library alone costs, to tell it apart from what radixkv.l2 adds."""
    import redis

    client = redis.Redis(port=port, socket_read_size=1024 * 1024)
    payload = os.urandom(size)
    calls = max(1, n // batch)
    rates = {}
    for op in ("SET", "GET"):
        start = time.perf_counter()
        for c in range(calls):
            pipe = client.pipeline(transaction=False)
            for i in range(batch):
                key = b"plain:%d" % ((c * batch + i) % 32)
                pipe.set(key, payload) if op == "SET" else pipe.get(key)
            pipe.execute()
        rates[op] = calls * batch / (time.perf_counter() - start)
    client.close()
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64 * 1024, 512 * 1024, 2 * 1024 * 1024])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument(
        "--bytes-per-round", type=int, default=64 * 1024 * 1024, help="data per side, op and round"
    )
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if shutil.which("redis-server") is None or shutil.which("redis-benchmark") is None:
        raise SystemExit("needs redis-server and redis-benchmark (apt-get install redis-server)")
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')}  load: {os.getloadavg()}  cpus: {os.cpu_count()}")
    print("# requests (blocks) per second, median of the rounds; sides interleaved round by round")
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(tmp).start()
        try:
            print(
                f"{'size':>9} {'B':>3} {'op':>3} {'redis-benchmark':>15} {'redis-py':>9} {'radixkv.l2':>10} "
                f"{'l2 MB/s':>8} {'l2/bench':>8}"
            )
            for size in args.sizes:
                n = max(4 * max(args.batches), args.bytes_per_round // size)
                for batch in args.batches:
                    runs = {"bench": [], "plain": [], "l2": []}
                    for _ in range(args.rounds):
                        runs["bench"].append(redis_benchmark(server.port, size, n, batch))
                        runs["plain"].append(plain_redis_py(server.port, size, n, batch))
                        runs["l2"].append(ours(server.url, size, n, batch))
                    for op in ("SET", "GET"):
                        med = {side: statistics.median(r[op] for r in rs) for side, rs in runs.items()}
                        print(
                            f"{size:>9} {batch:>3} {op:>3} {med['bench']:>15.0f} {med['plain']:>9.0f} "
                            f"{med['l2']:>10.0f} {med['l2'] * size / 1e6:>8.0f} {med['l2'] / med['bench']:>8.2f}"
                        )
        finally:
            server.kill()
    print(f"# load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
