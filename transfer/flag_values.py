"""Flag value types (argparse `type=`) that every layer declaring flags shares: the transports
declare theirs here in transfer (transfer.transports.kind), the commands theirs in
disagg.checks, and disagg may import transfer but not the other way round. Each mistake is one
line naming the value and what would work (argparse prints it beside the flag)."""

import argparse


def number(text: str, kind: type, noun: str):
    """int(text) or float(text), or the flag's one-line error."""
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None


def positive_int(text: str) -> int:
    """A flag's whole number of at least 1."""
    value = number(text, int, "an integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value
