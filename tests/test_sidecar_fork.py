"""fork() with sidecar-backed stores (radixkv.sidecar.forks), with a real sidecar and os.fork().

A child never talks on its parent's connection, never waits on a lock a parent thread held at
the fork (the tier's, the store's), and connects with its own hello on its first call; the
parent's connection, pins and counters are undisturbed. A child that fails exits with a code
the parent checks (never hangs the test: os._exit in a finally, waitpid in a bounded loop).
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
import traceback

import pytest

import hf_patch
from hf_patch.keys.weights import model_scope
from radixkv import pack_tokens
from tests.hf_models import assert_same_as_stock, build, ids
from tests.sidecar_process import (
    BS,
    DOC_LEN,
    PROMPT_HIT,
    QUESTION_LEN,
    prompt_of,
    sidecar_stats,
    start_sidecar,
)

CHILD_S = 120  # the longest the parent waits for its child at each step


@pytest.fixture
def sidecar(tmp_path):
    path = tmp_path / "s.sock"
    proc = start_sidecar(path)
    yield path, proc
    proc.kill()
    proc.wait()


def clients(path) -> int:
    """Connections the sidecar has now, besides the one asking."""
    return sidecar_stats(path)["clients"] - 1


def until(predicate, what: str, timeout_s: float = 30):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return value


def read_line(fd: int, child: int) -> bytes:
    """A line the child writes on ``fd``; fails (never hangs) when the child exits first."""
    got = b""
    deadline = time.monotonic() + CHILD_S
    while not got.endswith(b"\n"):
        if select.select([fd], [], [], 0.1)[0]:
            chunk = os.read(fd, 64)
            assert chunk, f"the child closed its pipe: {reap(child, 5)}"
            got += chunk
        assert time.monotonic() < deadline, "the child did not answer"
    return got


def reap(child: int, timeout_s: float = CHILD_S) -> int:
    """The child's exit code; SIGKILLs it (and fails) past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        pid, status = os.waitpid(child, os.WNOHANG)
        if pid:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
            pytest.fail("the child hung")
        time.sleep(0.05)


def test_a_forked_child_connects_on_its_own_and_leaves_the_parent_undisturbed(sidecar, monkeypatch):
    monkeypatch.setenv("RADIXKV_SIDECAR_TIMEOUT_S", "5")
    path, _proc = sidecar
    model = build("llama-sdpa")
    ns = (model_scope(model), None)
    a = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=path)
    b = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=path)
    assert_same_as_stock(model, ids(prompt_of(1)), a, max_new_tokens=2, do_sample=False)
    assert a.remote.flush(30) and a.stats()["sidecar_written_commits"] == 1
    # The parent holds a lease on the document through B (B's pool is empty: the sidecar's).
    lease = b.acquire(pack_tokens(prompt_of(1)), ns, count=False)
    assert lease.remote is not None
    pinned = sidecar_stats(path)["pinned_blocks"]
    assert pinned == lease.remote.num_tokens // BS > 0 and clients(path) == 2
    before = b.stats()

    # At the fork a parent thread holds B's connection (until after the fork) and another
    # B's store lock (for a while): neither is the child's to wait on.
    tier_held, store_held, forked = threading.Event(), threading.Event(), threading.Event()

    def hold_tier():
        with b.remote._lock:
            tier_held.set()
            forked.wait(60)

    def hold_store():
        with b._lock:
            store_held.set()
            time.sleep(1.0)

    threads = [threading.Thread(target=f, daemon=True) for f in (hold_tier, hold_store)]
    for t in threads:
        t.start()
    assert tier_held.wait(30) and store_held.wait(30)
    to_parent, from_child = os.pipe()[::-1]
    from_parent, to_child = os.pipe()
    child = os.fork()
    if child == 0:  # -- the child: exit codes name the check that failed ------------------
        code = 90
        try:
            import torch

            torch.set_num_threads(1)
            code = 91  # B reads the document through its own connection, equal to stock
            cache, _ = assert_same_as_stock(model, ids(prompt_of(1)), b, max_new_tokens=2, do_sample=False)
            assert cache.cached_tokens == [PROMPT_HIT]
            code = 92  # one hello of its own, nothing of the parent's undone or counted as lost
            stats = b.stats()
            assert stats["sidecar_connects"] == before["sidecar_connects"] + 1
            assert stats["sidecar_disconnects"] == before["sidecar_disconnects"] == 0
            assert stats["remote_hit_tokens"] == before["remote_hit_tokens"] + PROMPT_HIT
            code = 93  # B writes through (a writer thread of the child's): both prompts' commits
            assert_same_as_stock(model, ids(prompt_of(2)), b, max_new_tokens=2, do_sample=False)
            assert b.remote.flush(30)
            assert b.stats()["sidecar_written_commits"] == before["sidecar_written_commits"] + 2
            code = 94
            os.write(to_parent, b"ready\n")
            assert select.select([from_parent], [], [], CHILD_S)[0] and os.read(from_parent, 3) == b"go\n"
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    # -- the parent ---------------------------------------------------------------------------
    forked.set()
    os.close(to_parent)
    os.close(from_parent)
    try:
        assert read_line(from_child, child) == b"ready\n"
        # The child has one connection of its own, and has let the parent's copies go: when the
        # parent closes A, the sidecar sees A's connection end though the child still runs.
        assert clients(path) == 3
        assert sidecar_stats(path)["pinned_blocks"] == pinned  # the child's leases went back
        a.remote.close()
        until(lambda: clients(path) == 2, "the child kept the parent's socket open")
        os.write(to_child, b"go\n")
        assert reap(child) == 0, "the child failed (its exit code names the check)"
    finally:
        os.close(to_child)
        os.close(from_child)
        try:  # a check that failed before the child was reaped: it must not outlive the test
            if not os.waitpid(child, os.WNOHANG)[0]:
                os.kill(child, signal.SIGKILL)
                os.waitpid(child, 0)
        except ChildProcessError:
            pass  # reaped
    for t in threads:
        t.join(30)

    # The parent's lease is still pinned (the child neither released it nor ended it), B's
    # first connection still answers, and B reads what the child wrote, equal to stock.
    until(lambda: clients(path) == 1, "the child's connection did not close")
    assert sidecar_stats(path)["pinned_blocks"] == pinned
    cache, _ = assert_same_as_stock(model, ids(prompt_of(2)), b, max_new_tokens=2, do_sample=False)
    assert cache.cached_tokens == [PROMPT_HIT]
    stats = b.stats()
    assert stats["sidecar_connects"] == before["sidecar_connects"] == 1
    assert stats["sidecar_disconnects"] == 0 and stats["sidecar_timeouts"] == 0
    lease.release()
    until(lambda: sidecar_stats(path)["pinned_blocks"] == 0, "the parent's lease was not released")


def test_a_fork_the_hooks_did_not_see_is_found_by_the_pid(sidecar, monkeypatch):
    """A fork() outside os.fork() (a C library's) runs no at-fork hook: the tier finds it by its
    pid on the next call and drops the inherited connection there, sending nothing on it; a
    lease from before is never released on the new connection (not the child's). Simulated in
    one process: the tier's pid made another's."""
    from radixkv.sidecar.connection import Connection

    path, _proc = sidecar
    sent: list[tuple[Connection, dict]] = []
    orig_call = Connection.call

    def spy(self, header, *args, **kw):
        sent.append((self, header))
        return orig_call(self, header, *args, **kw)

    monkeypatch.setattr(Connection, "call", spy)
    model = build("llama-sdpa")
    ns = (model_scope(model), None)
    a = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=path)
    assert_same_as_stock(model, ids(prompt_of(1)), a, max_new_tokens=2, do_sample=False)
    assert a.remote.flush(30)
    b = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=path)
    lease = b.acquire(pack_tokens(prompt_of(1)), ns, count=False)
    old = b.remote._conn
    assert lease.remote is not None and old is not None
    held, done = threading.Event(), threading.Event()

    def hold_writer():  # as a parent's writer thread holding its queue's lock at the fork
        with b.remote.writer._cond:
            held.set()
            done.wait(60)

    threading.Thread(target=hold_writer, daemon=True).start()
    assert held.wait(30)
    b.remote._pid = -1  # the pid it had before a fork the hooks did not see
    try:
        assert b.remote.flush(30)  # a fresh queue: not the lock the "parent's" thread holds
        written = b.stats()["sidecar_written_commits"]
        cache, _ = assert_same_as_stock(model, ids(prompt_of(1)), b, max_new_tokens=2, do_sample=False)
        assert cache.cached_tokens == [PROMPT_HIT]
        assert b.remote.flush(30) and b.stats()["sidecar_written_commits"] == written + 1
    finally:
        done.set()
    assert b.remote._pid == os.getpid() and old.sock.fileno() == -1  # its copy closed
    stats = b.stats()
    assert stats["sidecar_connects"] == 2 and stats["sidecar_disconnects"] == 0
    new = b.remote._conn
    assert [h["op"] for c, h in sent if c is old][-1] == "match"  # nothing after the fork on it
    hit = lease.remote
    lease.release()
    assert b.remote.flush(30)
    assert [h for c, h in sent if c is new and h["op"] == "release"]  # its own leases' releases
    assert not [h for c, h in sent if c is new and h.get("lease") == hit.lease]


class _Reads:
    """A dataset whose items read a prompt's KV through a sidecar-backed store (in the worker)."""

    def __init__(self, store, prompts, ns):
        self.store, self.prompts, self.ns = store, prompts, ns

    def __len__(self):
        return len(self.prompts)

    def __getitem__(self, i):
        import torch

        store = self.store
        lease = store.acquire(pack_tokens(self.prompts[i]), self.ns, count=False)
        try:
            n = lease.num_tokens
            specs = store.pool.layers
            k = [torch.zeros(1, s.num_kv_heads, n, s.k_head_dim, dtype=s.dtype) for s in specs]
            v = [torch.zeros(1, s.num_kv_heads, n, s.v_head_dim, dtype=s.dtype) for s in specs]
            store.read([lease], n, k, v, count=False)
            remote = lease.remote is not None
        finally:
            lease.release()
        return n, remote, torch.cat([x.flatten() for x in k + v]), os.getpid()


def test_dataloader_workers_started_with_fork_read_through_their_own_connections(sidecar):
    """A DataLoader with fork-started workers over a store the parent already used (connected,
    its writer thread started): each worker reads the sidecar's blocks on a connection of its
    own, bit-equal to what the parent reads; the parent's connection is the first one after."""
    import torch
    from torch.utils.data import DataLoader

    path, _proc = sidecar
    model = build("llama-sdpa")
    ns = (model_scope(model), None)
    a = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=path)
    for seed in (1, 2):
        assert_same_as_stock(model, ids(prompt_of(seed)), a, max_new_tokens=2, do_sample=False)
    assert a.remote.flush(30)
    b = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=path)
    prompts = [prompt_of(1), prompt_of(2)]
    want = [_Reads(b, prompts, ns)[i] for i in range(2)]  # the parent: its own connection
    whole = (DOC_LEN + QUESTION_LEN) // BS * BS
    assert [w[:2] for w in want] == [(whole, True)] * 2
    seen = sidecar_stats(path)["clients_total"]  # (each stats call is a client too)
    loader = DataLoader(
        _Reads(b, prompts, ns), batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=120
    )
    got = list(loader)
    assert len({pid for *_, pid in got} - {os.getpid()}) == 2  # read in two children
    assert sidecar_stats(path)["clients_total"] == seen + 3  # a hello of each worker's own
    for (n, remote, kv, _), (wn, wremote, wkv, _) in zip(got, want):
        assert (n, remote) == (wn, wremote) and torch.equal(kv, wkv)
    stats = b.stats()
    assert stats["sidecar_connects"] == 1 and stats["sidecar_disconnects"] == 0
    until(lambda: sidecar_stats(path)["open_leases"] == 0, "a worker's lease was left pinned")
    assert _Reads(b, prompts, ns)[0][:2] == (whole, True)
