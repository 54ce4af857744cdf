"""End to end: real `python -m demo` replicas on one real sidecar process, over HTTP.

Replica B's first request on a document replica A computed reads it from the sidecar
(cached_tokens = the whole blocks the prompts share; B's /metrics counts them as sidecar hits)
and answers exactly as stock generate(); another tenant (API key) reads nothing of it; a
restarted A reads it back. At shutdown (SIGTERM) a replica hands the commits still queued for
the sidecar over before it exits (demo.shutdown_sidecar), and a hung sidecar costs it a bounded
wait and a log line, never a hang.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import time

import openai
import pytest
import requests
import torch

from demo.api.app import build_engine
from demo.config import Config
from demo.engine.generation import Params
from demo.shutdown_sidecar import FLUSH_S
from tests.demo_process import start_demo
from tests.sidecar_process import sidecar_stats, start_sidecar

BLOCK = 16
DOC = "A staff list:\n" + "\n".join(f"| Greta {i} | {20 + i} | Porto | nurse |" for i in range(24)) + "\n"
DOC2 = "Rooms:\n" + "\n".join(f"| room {i} | floor {i % 5} | {3 + i} beds |" for i in range(24)) + "\n"
Q1, Q2, Q3 = "How old is Greta 4?", "Where does Greta 17 live?", "Which floor is room 9 on?"
MAX_NEW = 6


@pytest.fixture(scope="module")
def oracle():
    """The built-in model without prefix reuse: chat ids and stock greedy generate()."""
    return build_engine(Config(model="builtin-tiny", reuse=False))


def stock(engine, content: str) -> str:
    ids = engine.chat_ids([{"role": "user", "content": content}])
    cfg = engine.runner.config(Params(MAX_NEW, temperature=0.0))
    out = engine.model.generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), generation_config=cfg
    )
    return engine.decode(out[0, len(ids) :].tolist())


def shared_blocks(engine, a: str, b: str) -> int:
    """Whole-block tokens two chat prompts share (what a replica that has one can reuse for the other)."""
    x, y = (engine.chat_ids([{"role": "user", "content": c}]) for c in (a, b))
    same = next(i for i, (p, q) in enumerate(zip(x, y)) if p != q) if x != y else len(x) - 1
    return min(same, len(y) - 1) // BLOCK * BLOCK


def replica_args(sock, secret) -> list[str]:
    # One tenant secret file for all replicas: a key names the same cache namespace on each.
    return ["--model", "builtin-tiny", "--block-size", str(BLOCK), "--cache-tokens", "16384", "--port", "0",
            "--sidecar", str(sock), "--api-keys", "key-a,key-b", "--tenant-secret-file", str(secret)]  # fmt: skip


def start_replicas(sock, secret, logs: list[str]) -> list[tuple[subprocess.Popen, str]]:
    with concurrent.futures.ThreadPoolExecutor(len(logs)) as pool:  # their start-ups overlap
        return list(pool.map(lambda log: start_demo(replica_args(sock, secret), log), logs))


def ask(url: str, content: str, key: str = "key-a"):
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)
    r = client.chat.completions.create(
        model="builtin-tiny",
        messages=[{"role": "user", "content": content}],
        max_tokens=MAX_NEW,
        temperature=0,
    )
    return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens


def sidecar_hits(url: str) -> int:
    text = requests.get(url + "/metrics", timeout=30).text
    return int(
        float(next(x for x in text.splitlines() if x.startswith("radixkv_sidecar_hits_total ")).split()[1])
    )


def wait_inserted(sock, tokens: int) -> None:
    """Until the sidecar holds ``tokens`` tokens inserted by commits (write-through is in the background)."""
    deadline = time.monotonic() + 60
    while sidecar_stats(sock)["inserted_tokens"] < tokens:
        assert time.monotonic() < deadline, sidecar_stats(sock)
        time.sleep(0.05)


def stop(proc: subprocess.Popen, timeout: float = 60) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()


def first_chunk_then(url: str, content: str, then) -> None:
    """Stream a long reply; on its first content chunk call ``then()`` (signals), then drop it."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="key-a", max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model="builtin-tiny", messages=[{"role": "user", "content": content}], max_tokens=400,
        temperature=0, stream=True,
    )  # fmt: skip
    try:
        next(c for c in stream if c.choices and c.choices[0].delta.content)
        then()
    finally:
        stream.close()


@pytest.fixture
def sidecar(tmp_path):
    sock = tmp_path / "kv.sock"
    proc = start_sidecar(sock, "64M")
    yield sock, proc
    os.kill(proc.pid, signal.SIGCONT)  # a test may have left it stopped
    proc.kill()
    proc.wait()


def test_replicas_share_a_document_tenants_stay_apart_and_a_restarted_replica_reads_it(
    sidecar, tmp_path, oracle
):
    sock, _ = sidecar
    secret = tmp_path / "tenants.secret"
    logs = [str(tmp_path / f"{n}.log") for n in ("a", "b", "a2")]
    procs = []
    try:
        (a, url_a), (b, url_b) = start_replicas(sock, secret, logs[:2])
        procs += [a, b]
        text_a, cached = ask(url_a, DOC + Q1)
        assert cached == 0 and text_a == stock(oracle, DOC + Q1)
        whole = len(oracle.chat_ids([{"role": "user", "content": DOC + Q1}])) // BLOCK * BLOCK
        wait_inserted(sock, whole)

        # Another tenant on B: nothing of A's document, locally or through the sidecar.
        text, cached = ask(url_b, DOC + Q1, key="key-b")
        assert cached == 0 and sidecar_hits(url_b) == 0 and text == text_a

        # The same tenant on B, another question: the document comes from the sidecar.
        shared = shared_blocks(oracle, DOC + Q1, DOC + Q2)
        assert shared > 300
        text, cached = ask(url_b, DOC + Q2)
        assert cached == shared and sidecar_hits(url_b) == shared
        assert text == stock(oracle, DOC + Q2)
        # A's own prompt on B: the rest of it comes from the sidecar too, and B answers as A did.
        text, cached = ask(url_b, DOC + Q1)
        assert cached == shared_blocks(oracle, DOC + Q1, DOC + Q1) and text == text_a
        assert sidecar_hits(url_b) > shared

        # A restarted: its pool is empty, the sidecar still has the document.
        assert stop(a) == 0, open(logs[0]).read()[-3000:]
        assert "queued commits written to the sidecar" in open(logs[0]).read()
        ((a2, url_a2),) = start_replicas(sock, secret, logs[2:])
        procs.append(a2)
        text, cached = ask(url_a2, DOC + Q1)
        assert cached == shared_blocks(oracle, DOC + Q1, DOC + Q1) and sidecar_hits(url_a2) == cached
        assert text == text_a
        # key-b's own copy (B computed it for key-b above) reaches A2 for key-b, apart from key-a's.
        text, cached = ask(url_a2, DOC + Q2, key="key-b")
        assert cached == shared and text == stock(oracle, DOC + Q2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def test_sigterm_hands_queued_commits_to_the_sidecar_and_a_hung_sidecar_costs_a_bounded_wait(
    sidecar, tmp_path, oracle
):
    """Writer W is cut by SIGTERM mid-reply while the sidecar is paused (SIGSTOP), so the
    commit of what W computed is still queued when W starts to exit: W waits for the sidecar
    (resumed 0.6 s later) and replica R reads the document from it. Then the same for R with a
    sidecar that never resumes: R exits within its bound, saying the commits were dropped."""
    sock, sidecar_proc = sidecar
    secret = tmp_path / "tenants.secret"
    logs = [str(tmp_path / f"{n}.log") for n in ("w", "r")]
    procs = []
    try:
        (w, url_w), (r, url_r) = start_replicas(sock, secret, logs[:2])
        procs += [w, r]
        before = sidecar_stats(sock)["inserted_tokens"]

        def pause_and_stop():
            os.kill(sidecar_proc.pid, signal.SIGSTOP)
            w.send_signal(signal.SIGTERM)

        first_chunk_then(url_w, DOC2 + Q3, pause_and_stop)
        try:
            with pytest.raises(subprocess.TimeoutExpired):
                w.wait(timeout=0.6)  # W waits for the paused sidecar instead of exiting
        finally:
            os.kill(sidecar_proc.pid, signal.SIGCONT)
        assert w.wait(timeout=60) == 0, open(logs[0]).read()[-3000:]
        log = open(logs[0]).read()
        assert "queued commits written to the sidecar" in log and "dropped" not in log, log[-3000:]
        assert sidecar_stats(sock)["inserted_tokens"] > before

        shared = shared_blocks(oracle, DOC2 + Q3, DOC2 + Q1)
        text, cached = ask(url_r, DOC2 + Q1)
        assert cached == shared > 300 and sidecar_hits(url_r) == shared
        assert text == stock(oracle, DOC2 + Q1)

        # A sidecar that stops answering for good: R's exit waits at most FLUSH_S for it.
        def pause_for_good_and_stop():
            os.kill(sidecar_proc.pid, signal.SIGSTOP)
            r.send_signal(signal.SIGTERM)
            pause_for_good_and_stop.at = time.monotonic()

        first_chunk_then(url_r, DOC + Q3, pause_for_good_and_stop)
        assert r.wait(timeout=60) == 0, open(logs[1]).read()[-3000:]
        assert time.monotonic() - pause_for_good_and_stop.at < FLUSH_S + 15  # bounded, not hung
        log = open(logs[1]).read()
        assert "queued for the sidecar" in log and "were dropped" in log, log[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
