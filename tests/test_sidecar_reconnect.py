"""A write across a reconnect: a commit belongs to its alloc's connection (generation).

The sidecar is restarted between the writer's alloc and its commit, and another call of the
same tier attaches to the new sidecar meanwhile: the commit is dropped and counted, never sent
on the new connection (whose sidecar holds no such transaction, or another one with its id).
With a real sidecar process; every output equals stock generate().
"""

from __future__ import annotations

import time

import hf_patch
from radixkv.sidecar.connection import Connection, SidecarDown
from tests.hf_models import assert_same_as_stock, build, ids
from tests.sidecar_process import (
    BS,
    PROMPT_HIT,
    after_copy,
    prompt_of,
    sidecar_stats,
    start_sidecar,
)


def test_a_commit_from_an_older_connection_is_dropped_not_sent(tmp_path, monkeypatch):
    path = tmp_path / "s.sock"
    procs = [start_sidecar(path)]
    sent: list[tuple[Connection, str]] = []  # (connection, op) of every request sent (kept alive)
    orig_call = Connection.call

    def spy(self, header, *args, **kw):
        sent.append((self, header["op"]))
        return orig_call(self, header, *args, **kw)

    monkeypatch.setattr(Connection, "call", spy)

    def restart() -> None:  # between the writer's alloc and its commit: a new sidecar, attached
        procs[0].kill()
        procs[0].wait()
        procs.append(start_sidecar(path))
        deadline = time.monotonic() + 30
        while True:  # another call of the tier finds the old one gone and attaches to the new
            try:
                a.remote.call({"op": "stats"})
                break
            except SidecarDown:
                assert time.monotonic() < deadline, "never attached to the new sidecar"
                time.sleep(0.05)

    after_copy(monkeypatch, restart, once=True)
    try:
        model = build("llama-sdpa")
        a = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=path)
        assert_same_as_stock(model, ids(prompt_of(1)), a, max_new_tokens=2, do_sample=False)
        assert a.remote.flush(30)
        stats = a.stats()
        assert stats["sidecar_connects"] == 2 and len(procs) == 2  # restarted between alloc and commit
        new = next(conn for conn, op in reversed(sent) if op == "hello")
        assert [op for conn, op in sent if conn is new] == ["hello", "stats"]  # no commit, no abort
        assert stats["sidecar_stale_commits"] == stats["sidecar_failed_writes"] == 1
        assert stats["sidecar_refused"] == stats["sidecar_written_commits"] == 0
        new_stats = sidecar_stats(path)
        assert new_stats["open_txns"] == new_stats["cached_blocks"] == 0

        # The writer goes on, on the new connection: the next prompt is written and read back.
        assert_same_as_stock(model, ids(prompt_of(2)), a, max_new_tokens=2, do_sample=False)
        assert a.remote.flush(30) and a.stats()["sidecar_written_commits"] == 1
        assert [op for conn, op in sent if conn is new][-2:] == ["alloc", "commit"]
        b = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=path)
        cache, _ = assert_same_as_stock(model, ids(prompt_of(2)), b, max_new_tokens=2, do_sample=False)
        assert cache.cached_tokens == [PROMPT_HIT]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
