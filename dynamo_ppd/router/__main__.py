"""`python -m dynamo_ppd.router`: the old path of `python -m dynamo_ppd.relay` (a shim)."""

from ..relay.service import main

main()
