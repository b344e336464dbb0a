"""What the router sends a request through: a Pair of instances (a prefill instance and a
decode instance, each one worker URL per TP rank). One instance's answer is merged from its
ranks' answers in router/answers.py.

    --pair http://p0:8080+http://p1:8080,http://d0:8080,main
           |-- prefill TP 2 ---------------| |-- decode TP 1 -| bootstrap
"""

import argparse
import urllib.parse
from dataclasses import dataclass


@dataclass(frozen=True)
class Pair:
    """A prefill instance and a decode instance: each one worker URL per TP rank (every rank
    of both takes part in every request), and the bootstrap decode looks prefill up at."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    bootstrap: str

    def __post_init__(self) -> None:  # one URL: an instance of one rank
        for side in ("prefill", "decode"):
            if isinstance(getattr(self, side), str):
                object.__setattr__(self, side, (getattr(self, side),))

    @staticmethod
    def parse(text: str) -> "Pair":
        """--pair PREFILL_URL[+URL...],DECODE_URL[+URL...],BOOTSTRAP (a name decode knows, or
        its address); several URLs on a side are that instance's TP ranks."""
        parts = text.split(",")
        if len(parts) == 2:  # a vLLM pair (`--backend vllm`): no bootstrap
            parts.append("")
        if len(parts) != 3 or not all(parts[:2]) or (len(text.split(",")) == 3 and not parts[2]):
            raise argparse.ArgumentTypeError(
                f"want PREFILL_URL,DECODE_URL,BOOTSTRAP (e.g. http://10.0.0.5:8080,"
                f"http://10.0.0.6:8080,main; ranks of a TP instance joined by +; "
                f"PREFILL_URL,DECODE_URL for --backend vllm), got {text!r}"
            )
        sides = [tuple(part.split("+")) for part in parts[:2]]
        for url in (u for side in sides for u in side):
            try:
                parsed = urllib.parse.urlsplit(url)
                port = parsed.port
            except ValueError:
                port = None
            if parsed.scheme not in ("http", "https") or not parsed.hostname or port is None:
                raise argparse.ArgumentTypeError(f"{url!r} is not http://HOST:PORT")
        for side in sides:
            if len(set(side)) != len(side):
                raise argparse.ArgumentTypeError(f"{'+'.join(side)}: a rank's URL given twice")
        return Pair(sides[0], sides[1], parts[2])

    def __str__(self) -> str:  # as --pair takes it
        tail = f",{self.bootstrap}" if self.bootstrap else ""
        return f"{'+'.join(self.prefill)},{'+'.join(self.decode)}{tail}"


def side_name(role: str, rank: int, pair: Pair) -> str:
    return f"{role} rank {rank}" if len(getattr(pair, role)) > 1 else role
