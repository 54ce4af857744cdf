"""The engine core in its own process (``--api-server-count N``, docs/design.md#processes).

``wire``: the msgspec messages between front ends and the engine process; ``engine_process``:
the engine process's main (the scheduler, step loop, model and store, served over ZMQ);
``front_end``: an HTTP front end's main (the Flask app over ``demo.api.engine_client``);
``supervisor``: the process ``python -m demo`` runs, which starts the others and restarts them.
"""
