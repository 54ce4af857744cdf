"""Pinned blocks of the demo's task prompts with 0, 2 and 8 API keys (built-in model, a
32,768-token pool, two task prompts of 800 words, chat and completion forms each).

    python -m benchmarks.bench_task_pins
"""

from __future__ import annotations

import json

from demo.api.app import build_engine, create_app
from demo.config import Config
from demo.task_prompts import TaskPromptError

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
TASKS = [
    {"task_id": f"t{t}", "prompt": " ".join(WORDS[(i * (t + 3)) % 10] for i in range(800))} for t in range(2)
]


def main() -> None:
    for keys in [(), ("k1", "k2"), tuple(f"k{i}" for i in range(8))]:
        engine = build_engine(Config(model="builtin", cache_tokens=1 << 15))
        try:
            create_app(Config(model="builtin", task_prompts_json=json.dumps(TASKS), api_keys=keys), engine)
        except TaskPromptError as e:
            print(f"{len(keys)} keys: the server refuses to start: {e}")
            continue
        stats = engine.stats()
        print(
            f"{len(keys)} keys: task_prompts {stats['task_prompts']}, "
            f"pinned blocks {stats['task_pinned_blocks']} of {engine.store.pool.num_blocks}"
        )


if __name__ == "__main__":
    main()
