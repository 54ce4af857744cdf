"""``radixkv cache inspect FILE [--verify] [--json]``: what a cache file holds, and whether it is
intact, without loading a model or starting a server (radixkv.persist.inspect_file)."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="radixkv cache", description="Cache files (saved by --cache-file, save_cache, the sidecar)."
    )
    sub = parser.add_subparsers(dest="action", required=True)
    inspect = sub.add_parser("inspect", help="print a cache file's model, layout, counts and namespaces")
    inspect.add_argument("file")
    inspect.add_argument(
        "--verify", action="store_true", help="also check every tensor's checksum (reads the whole file)"
    )
    inspect.add_argument("--json", action="store_true", help="print the description as JSON")
    args = parser.parse_args(argv)
    from radixkv.persist.inspect_file import describe, summary
    from radixkv.persist.manifest import CacheFileError

    try:
        info = describe(args.file, verify=args.verify)
    except (CacheFileError, OSError) as e:
        print(f"radixkv cache inspect: {e}", file=sys.stderr)
        return 2
    print(json.dumps(info, indent=2) if args.json else summary(info))
    return 1 if info.get("verified") is False else 0
