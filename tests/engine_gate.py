"""A gate for engine tests: hold the demo's worker inside a first generate() while the requests
under test queue, so they are taken together; and collect several requests at once."""

from __future__ import annotations

import threading

from demo.engine.engine import Params


class Held:
    """Holds the worker inside a blocker's generate() until released, while the requests under
    test queue."""

    def __init__(self, engine, monkeypatch):
        self.entered, self.release = threading.Event(), threading.Event()
        generate = engine.model.generate

        def held(*args, **kwargs):
            if not self.release.is_set():
                self.entered.set()
                assert self.release.wait(60)
            return generate(*args, **kwargs)

        monkeypatch.setattr(engine.model, "generate", held)
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
