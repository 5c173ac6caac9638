"""`python -m dynamo_ppd.gateway`: the local gateway (see `dynamo_ppd.gateway`); wiring only."""

from __future__ import annotations

import asyncio
import logging
import sys

from .args import PROG, parse_args
from .proxy import serve


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(config))
    except OSError as exc:  # a port is taken, or the host is not ours
        print(f"{PROG}: error: {exc}; pick a free port", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
