"""`dynamo-ppd chaos` command line (filled in below)."""

from __future__ import annotations

import argparse

DESCRIPTION = "Chaos harness (being built)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def main(args: argparse.Namespace) -> int:
    return 2
