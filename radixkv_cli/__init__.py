"""``radixkv``: one command for radixkv's programs, each one a subcommand taking its own flags.

    radixkv serve [FLAGS]          the chat page and OpenAI-compatible server (python -m demo)
    radixkv sidecar [FLAGS]        the cache process shared by local processes (python -m radixkv.sidecar)
    radixkv batch [FLAGS]          an OpenAI batch file (python -m batchrun)
    radixkv eval [FLAGS]           lm-eval with prefix reuse (python -m evalrun)
    radixkv save-builtin DIR       the built-in model as a checkpoint folder
    radixkv cache inspect FILE     what a cache file holds, and whether it is intact (--verify)

``radixkv SUBCOMMAND --help`` lists that program's flags. The ``python -m`` forms stay. Under a
launcher, ``torchrun --no-python radixkv batch ...`` or ``accelerate launch --no_python radixkv
eval ...`` start one rank a process, as ``-m batchrun`` / ``-m evalrun`` do.

The top of the import graph: it imports the applications (demo, batchrun, evalrun) and the
sidecar, and nothing imports it. Each program is imported only when its subcommand runs, so
``radixkv sidecar`` never loads the server's modules and ``radixkv --help`` loads nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence


def _serve(argv: list[str]) -> int:
    from demo.__main__ import main

    return main(argv)


def _sidecar(argv: list[str]) -> int:
    from radixkv.sidecar.__main__ import main

    return main(argv)


def _batch(argv: list[str]) -> int:
    from batchrun.runner import run

    return run(argv)


def _eval(argv: list[str]) -> int:
    from evalrun.cli import main

    return main(argv)


def _cache(argv: list[str]) -> int:
    from radixkv_cli.cache import main

    return main(argv)


def _save_builtin(argv: list[str]) -> int:
    from demo.save_builtin import main

    return main(argv)


# name -> (what it runs, the python -m form it stands for)
COMMANDS: dict[str, tuple[Callable[[list[str]], int], str, str]] = {
    "serve": (_serve, "python -m demo", "the chat page and OpenAI-compatible server"),
    "sidecar": (_sidecar, "python -m radixkv.sidecar", "the cache process shared by local processes"),
    "batch": (_batch, "python -m batchrun", "an OpenAI batch file, over torchrun / accelerate ranks"),
    "eval": (_eval, "python -m evalrun", "lm-eval's command line with prefix reuse"),
    "save-builtin": (
        _save_builtin,
        "python -m demo save-builtin",
        "the built-in model as a checkpoint folder",
    ),
    "cache": (_cache, "radixkv cache inspect FILE", "what a cache file holds, and whether it is intact"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [
        "usage: radixkv SUBCOMMAND [FLAGS]   (radixkv SUBCOMMAND --help for its flags)",
        "",
        "subcommands:",
    ]
    for name, (_, form, what) in COMMANDS.items():
        lines.append(f"  {name:<{width}}  {what} ({form})")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(usage(), file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] == "--version":
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"radixkv {version('radixkv')}")
        except PackageNotFoundError:  # run from a source tree that was never installed
            print("radixkv (not installed: run from a source tree)")
        return 0
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"radixkv: no subcommand {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    return command[0](argv[1:]) or 0
