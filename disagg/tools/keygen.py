"""`disagg keygen FILE`: write a new deployment key (CURVE key pair) for --auth-key."""

import argparse
import os

from disagg.control.auth import AuthKey
from disagg.errors import ConfigError

HELP = "write a new deployment key for --auth-key (every process of a deployment takes the same file)"


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="where to write it (must not exist; readable by its owner only)")


def run(args: argparse.Namespace) -> int:
    if os.path.exists(args.file):
        raise ConfigError(f"{args.file} exists: a key is never overwritten (remove it first)")
    try:
        key = AuthKey.generate(args.file)
    except OSError as exc:
        raise ConfigError(f"cannot write {args.file}: {exc.strerror}") from None
    print(
        f"wrote {args.file} (public key {key.public.decode()}); give every process --auth-key {args.file}, "
        f"or on Kubernetes: kubectl create secret generic disagg-auth --from-file=deployment.key={args.file}"
    )
    return 0
