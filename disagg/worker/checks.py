"""Flag values checked when they are parsed or before anything starts: each mistake becomes
one line naming the flag, the value and what would work (argparse prints it, or the CLI
prints the ConfigError), never a traceback from deep inside the pool or a socket."""

import argparse

from disagg.errors import ConfigError


def power_of_two(text: str) -> int:
    """--page-size: a power of two in [1, 4096]."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 1 <= value <= 4096 or value & (value - 1):
        raise argparse.ArgumentTypeError(f"{value} is not a power of two in [1, 4096] (e.g. 1, 16, 64)")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def cuda_device(device: str) -> None:
    """--device cuda[:N] where torch sees that GPU, else a ConfigError saying what would work."""
    if not device.startswith("cuda"):
        return
    import torch
    if not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: torch sees no CUDA device on this machine (torch "
                          f"{torch.__version__}); use --device cpu, or auto")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ConfigError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s) "
                          f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})")


def share(text: str) -> float:
    """A fraction in [0, 1] (--check-rate)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value:g} is not in [0, 1]")
    return value
