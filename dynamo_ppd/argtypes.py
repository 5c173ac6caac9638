"""argparse types shared by the command lines (`dynamo_ppd.cli`) and the experiment shells in
`dynamo_ppd.bench`, and the one-line error they end with on a setting the user can fix. A bottom
module: it imports nothing of the package, so any layer may use it."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any


def cli_error(message: object, code: int = 2) -> int:
    """Print ``dynamo-ppd: error: message`` on stderr (argparse's form) and return the exit code:
    2 for settings the user can fix, 1 for a run that failed."""
    print(f"dynamo-ppd: error: {message}", file=sys.stderr)
    return code


def _positive(text: str, parse: Callable[[str], Any], what: str) -> Any:
    try:
        value = parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be positive")
    return value


def fraction(text: str) -> float:
    """An argparse type: a number from 0 to 1 (a share, a probability)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number from 0 to 1") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is outside 0-1")
    return value


def positive_seconds(text: str) -> float:
    """An argparse type: a positive number of seconds."""
    return _positive(text, float, "a number of seconds")


def positive_float(text: str) -> float:
    """An argparse type: a positive number."""
    return _positive(text, float, "a number")


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    return _positive(text, int, "a whole number")


def _positive_list(kind: str, number: Callable[[str], Any], example: str):
    def parse(text: str) -> list:
        try:
            values = [number(item) for item in text.split(",") if item.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not comma-separated {kind} like {example}") from None
        if not values or min(values) <= 0:
            raise argparse.ArgumentTypeError(f"{text!r}: {kind} must be positive")
        return values

    return parse


def positive_floats(kind: str = "values"):
    """An argparse type: a comma-separated list of positive numbers (rates, weights)."""
    return _positive_list(kind, float, "0.5,1,2")


def positive_ints(kind: str = "values"):
    """An argparse type: a comma-separated list of positive integers (TP degrees)."""
    return _positive_list(kind, int, "1,2,4,8")


def comma_choices(kind: str, choices, separator: str = ", "):
    """An argparse type: a comma-separated list, each item one of ``choices`` (in order given)."""
    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        unknown = [item for item in items if item not in choices]
        if unknown or not items:
            raise argparse.ArgumentTypeError(f"unknown {kind} {unknown[0] if unknown else text!r}; "
                                             f"choose from {separator.join(choices)}")
        return items

    return parse


def replica_counts(text: str) -> dict[str, int]:
    """An argparse type: replica counts per component, NAME=COUNT,... (e.g. prefill=2,decode=2)."""
    out = {}
    for item in text.split(","):
        name, _, count = item.partition("=")
        if not name or not count.isdigit():
            raise argparse.ArgumentTypeError(f"{item!r} is not NAME=COUNT (e.g. prefill=2)")
        out[name.strip()] = int(count)
    return out


def up_down(kind: Callable[[str], Any]):
    """An argparse type: ``UP,DOWN`` thresholds with UP > DOWN >= 0, each parsed by ``kind``."""

    def parse(text: str) -> tuple:
        try:
            up, down = (kind(part) for part in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected UP,DOWN (two numbers), not {text!r}") from None
        if not up > down >= 0:
            raise argparse.ArgumentTypeError(f"need UP > DOWN >= 0, not {text!r}")
        return up, down

    return parse
