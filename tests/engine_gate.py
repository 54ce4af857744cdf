"""A gate for engine tests: hold the demo's worker inside a first generate() while the requests
under test queue, so they are taken together; and collect several requests at once."""

from __future__ import annotations

import threading

from demo.engine.engine import Params


class Held:
    """Holds the worker inside a blocker's generate() call, or its seating in the step loop
    (RunningBatch.seat), until released, while the requests under test queue."""

    def __init__(self, engine, monkeypatch):
        from hf_patch.running_batch import RunningBatch

        self.entered, self.release = threading.Event(), threading.Event()

        def hold(call):
            def held(*args, **kwargs):
                if not self.release.is_set():
                    self.entered.set()
                    assert self.release.wait(60)
                return call(*args, **kwargs)

            return held

        monkeypatch.setattr(engine.model, "generate", hold(engine.model.generate))
        monkeypatch.setattr(RunningBatch, "seat", hold(RunningBatch.seat))
        self.blocker = engine.submit(engine.text_ids("blocker"), Params(1, temperature=0.0))
        assert self.entered.wait(30)

    def go(self):
        self.release.set()
        self.blocker.collect()


def collect_all(gens) -> list:
    out = [None] * len(gens)

    def run(i):
        out[i] = gens[i].collect()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(gens))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def spy_batches(monkeypatch, least: int = 1) -> list[int]:
    """Sizes (in requests) of the batches the worker forms, of at least ``least`` requests, on
    either decoding path: each generate() call of demo.engine.batching.run_batch, and each
    admission into the step loop (demo.engine.step_loop.StepLoop._join: one prefill call, or
    rows seated for one step)."""
    from demo.engine import batching
    from demo.engine.step_loop import StepLoop

    sizes, run, admit = [], batching.run_batch, StepLoop._join

    def spy_run(runner, gens, *args):
        if len(gens) >= least:
            sizes.append(len(gens))
        return run(runner, gens, *args)

    def spy_admit(loop, gens):
        if len(gens) >= least:
            sizes.append(len(gens))
        return admit(loop, gens)

    monkeypatch.setattr(batching, "run_batch", spy_run)
    monkeypatch.setattr(StepLoop, "_join", spy_admit)
    return sizes


def generate_path(engine, monkeypatch) -> None:
    """Make ``engine`` decode in generate() calls paused every decode_chunk steps (the path of
    adapter and image requests) instead of the step loop, for this test: as an engine without
    a loop (no step-loop path for the scheduler, so no admission budget either)."""
    monkeypatch.setattr(engine, "loop", None)
    monkeypatch.setattr(engine.scheduler, "path", lambda gen: None)


class Calls:
    """Rows and whether pixels were given, per generate() call of the engine's model."""

    def __init__(self, engine, monkeypatch):
        self.rows: list[tuple[int, bool]] = []
        generate = engine.model.generate

        def spy(input_ids, *args, **kwargs):
            self.rows.append((input_ids.shape[0], "pixel_values" in kwargs))
            return generate(input_ids, *args, **kwargs)

        monkeypatch.setattr(engine.model, "generate", spy)
