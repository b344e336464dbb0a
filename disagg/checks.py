"""Flag values checked when they are parsed or before anything starts: each mistake becomes
one line naming the flag, the value and what would work (argparse prints it, or the CLI
prints the ConfigError), never a traceback from deep inside the pool or a socket."""

import argparse

from disagg.errors import ConfigError
from kvpool.errors import SpecError
from kvpool.spec import check_page_size
from transfer.flag_values import number
from transfer.flag_values import positive_int as positive_int  # the transports' flags use it too


def power_of_two(text: str) -> int:
    """--page-size: a power of two in [1, 4096] (the pools' rule, kvpool.spec.check_page_size,
    and a cap for a flag)."""
    value = number(text, int, "an integer")
    try:
        check_page_size(value)
    except SpecError:
        value_ok = False
    else:
        value_ok = value <= 4096
    if not value_ok:
        raise argparse.ArgumentTypeError(f"{value} is not a power of two in [1, 4096] (e.g. 1, 16, 64)")
    return value


def milliseconds(text: str) -> float:
    """A positive duration in milliseconds."""
    return _duration(text, "milliseconds")


def cuda_device(device: str) -> None:
    """--device cuda[:N] where torch sees that GPU, else a ConfigError saying what would work."""
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            f"--device {device}: torch sees no CUDA device on this machine (torch "
            f"{torch.__version__}); use --device cpu, or auto"
        )
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ConfigError(
            f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s) "
            f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})"
        )


def share(text: str) -> float:
    """A fraction in [0, 1] (--check-rate)."""
    value = number(text, float, "a number")
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value:g} is not in [0, 1]")
    return value


def share_above_zero(text: str) -> float:
    """A fraction in (0, 1] (--swa-share)."""
    value = number(text, float, "a number")
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value:g} is not in (0, 1]")
    return value


def non_negative_int(text: str) -> int:
    """A flag's whole number of at least 0."""
    value = number(text, int, "an integer")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be at least 0")
    return value


def token_lengths(spec: str) -> str:
    """A length in tokens, N or MIN:MAX with 1 <= MIN <= MAX, plain integers (--prompt-len,
    --user-len); kept as given, drawn from per request or turn."""
    lo, sep, hi = spec.partition(":")
    if not (lo.isdigit() and (hi.isdigit() or not sep) and 1 <= int(lo) <= int(hi or lo)):
        raise argparse.ArgumentTypeError(
            f"{spec!r}: want N or MIN:MAX with 1 <= MIN <= MAX, plain integers (e.g. 2048 or 128:4096)"
        )
    return spec


def weight(text: str) -> float:
    """A finite number >= 0 (--kv-load-weight)."""
    value = number(text, float, "a number")
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number >= 0")
    return value


def port(text: str) -> int:
    """A TCP port, 0 meaning any free one."""
    value = number(text, int, "a port number")
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port in [0, 65535] (0: any free port)")
    return value


def seconds(text: str) -> float:
    """A positive duration in seconds."""
    return _duration(text, "seconds")


def _duration(text: str, unit: str) -> float:
    value = number(text, float, f"a number of {unit}")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a positive number of {unit}")
    return value


UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": 1 << 10,
    "m": 1 << 20,
    "g": 1 << 30,
    "t": 1 << 40,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def byte_size(text: str) -> int:
    """A byte count: 8GiB, 512MiB, 1.5GB, 4096 (K/M/G/T and KiB.. are powers of 1024; KB.. of 1000)."""
    figure = text.strip().rstrip("BbIiKkMmGgTt ")
    unit = text.strip()[len(figure) :].strip().lower()
    try:
        value = float(figure) * UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 8GiB, 512MiB, 1.5GB or a byte count)") from None
    if not 1 <= value < 1 << 60:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1 byte")
    return int(value)


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def device_name(text: str) -> str:
    """--device: cpu, cuda, cuda:N or auto (whether that GPU exists is checked at start)."""
    kind, sep, index = text.partition(":")
    if text in ("auto", "cpu", "cuda") or (kind == "cuda" and sep and index.isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: want cpu, cuda, cuda:N or auto")
