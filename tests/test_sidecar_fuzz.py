"""A bounded, seeded fuzz of the sidecar's protocol against a real sidecar process
(tests/sidecar_fuzz.py; run a longer one by hand: ``python -m tests.sidecar_fuzz --frames N``).

The sidecar must survive every frame, never raise on one (no "its request raised" in its log),
keep a correct client's KV and snapshots intact beside the hostile ones, and hold nothing of theirs once they
are gone."""

from __future__ import annotations

import pytest

from tests.sidecar_fuzz import fuzz, settled
from tests.sidecar_process import SidecarLog, start_sidecar


@pytest.mark.parametrize("seed", [1])
def test_random_frames_and_every_cut_leave_the_sidecar_serving_correct_kv(tmp_path_factory, seed):
    path = tmp_path_factory.mktemp("fz") / "s.sock"
    proc = start_sidecar(path, "256M")
    log = SidecarLog(proc)
    try:
        counts = fuzz(str(path), seed, frames=1500)
        stats = settled(str(path))
        assert proc.poll() is None, counts
    finally:
        proc.terminate()
        log = log.finished(proc)
    assert "its request raised" not in log and "Traceback" not in log, log[-3000:]
    assert (
        stats["open_leases"] == stats["open_txns"] == stats["private_blocks"] == stats["pinned_blocks"] == 0
    )
    assert stats["private_snapshots"] == 0 and stats["pools"] >= 3, stats
    assert stats["claims"] == 0 and stats["clients"] == 1  # the stats call's own connection
    # The fuzz reached the state, not only the parser: leases and writes granted to hostile
    # clients and commits of theirs that landed; errors and dropped connections; every cut.
    assert counts["frames"] == 1500 and counts["cuts"] > 300 and counts["kv_checks"] == 6, counts
    assert counts["replies"] > 500 and counts["errors"] > 100 and counts["dropped"] > 10, counts
    assert counts["granted"] > 10 and counts["committed"] > 0, counts
    # and the snapshot fields: state slots granted to hostile allocs (aborted or left open by them),
    # the correct client's 4 rounds of 2 snapshots committed
    assert counts["snap_slots"] > 0 and stats["aborted_snapshots"] > 0, (counts, stats)
    assert stats["inserted_snapshots"] >= 8, stats
