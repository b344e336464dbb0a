"""`disagg presets`: the model presets with per-component KV sizes."""

import argparse
import json

from kvpool.errors import SpecError
from kvpool.geometry import Component, bytes_per_request, bytes_per_token, components, layer_group
from kvpool.presets import PRESETS
from kvpool.spec import ModelSpec

HELP = "list model presets with bytes per token (and per request for state components)"


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object keyed by preset (TP 1 figures)")
    p.add_argument("--tp", type=int, default=8, help="TP size for the per-shard column (default 8)")


def describe(model: ModelSpec) -> dict:
    """The JSON entry of one preset: whole-model (TP 1) figures per component."""
    comps = []
    for c in components(model):
        if c.metadata:
            continue  # disagg's own record, not model geometry
        entry = {"kind": c.value, "num_layers": len(layer_group(model, c).layers)}
        if c.per_request:
            entry["bytes_per_request"] = bytes_per_request(model, c)
        else:
            entry["bytes_per_token"] = bytes_per_token(model, c)
        comps.append(entry | c.spec.describe(model))  # what the component adds (window, attention, ...)
    return {"layers": model.num_layers, "page_size": model.default_page_size, "components": comps}


def _shard(model: ModelSpec, c: Component, tp: int) -> str:
    try:
        fn = bytes_per_request if c.per_request else bytes_per_token
        return f"{fn(model, c, tp):,}"
    except SpecError:
        return "indivisible"


def run(args: argparse.Namespace) -> int:
    if args.tp < 1:
        raise SystemExit("--tp must be >= 1")
    if args.json:
        print(json.dumps({name: describe(m) for name, m in PRESETS.items()}, indent=2))
        return 0
    tp = args.tp
    header = (
        f"{'preset':<20} {'layers':>6} {'page':>4}  {'component':<10} {'n':>3} {'window':>6} "
        f"{'B/token':>12} {f'B/token TP{tp}':>13} {'B/request':>13} {f'B/request TP{tp}':>15}"
    )
    print(header)
    print("-" * len(header))
    for name, model in PRESETS.items():
        first = True
        for entry in describe(model)["components"]:
            c = Component(entry["kind"])
            kind = f"{c.value}({entry['attention']})" if "attention" in entry else c.value
            lead = f"{name:<20} {model.num_layers:>6} {model.default_page_size:>4}" if first else " " * 32
            per_tok = f"{entry['bytes_per_token']:,}" if not c.per_request else "-"
            per_req = f"{entry['bytes_per_request']:,}" if c.per_request else "-"
            print(
                f"{lead}  {kind:<10} {entry['num_layers']:>3} {entry.get('window', '-'):>6} "
                f"{per_tok:>12} {(_shard(model, c, tp) if not c.per_request else '-'):>13} "
                f"{per_req:>13} {(_shard(model, c, tp) if c.per_request else '-'):>15}"
            )
            first = False
    return 0
