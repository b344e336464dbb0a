"""Model engines by name: `--engine` takes one of these (checked when flags are parsed).

    auto      model where the preset is a model family (tiny-model-*, model-*) or a model is
              given (--model PATH, --model-type), else standin
    standin   deterministic bytes for any preset (fast; the default for geometry presets)
    model     transformers model code: a family's or --model-type's seeded random weights, or a
              --model directory's own (disagg.engine.model)

Building the model engine imports transformers (seconds), so only a process that asks for it
pays that.
"""

import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING

from disagg.engine.model.families import FAMILIES
from disagg.engine.model.source import ModelSource
from disagg.errors import ConfigError

if TYPE_CHECKING:
    from disagg.engine.base import ModelEngine


def _standin(
    preset: str,
    device: str,
    simulate_layer_ms: float = 0.0,
    source: ModelSource | None = None,
    *,
    prefill_chunk: int | None = None,
) -> "ModelEngine":
    if source is not None:
        raise ConfigError("--model / --model-type need the model engine (--engine model or auto), not the stand-in")
    if prefill_chunk is not None:
        raise ConfigError("--prefill-chunk is for the model engine; the stand-in computes no passes")
    from disagg.engine.standin import StandInEngine

    return StandInEngine(simulate_layer_ms)


def _model(
    preset: str,
    device: str,
    simulate_layer_ms: float = 0.0,
    source: ModelSource | None = None,
    *,
    prefill_chunk: int | None = None,
) -> "ModelEngine":
    if simulate_layer_ms:
        raise ConfigError("--simulate-layer-ms is for the stand-in engine; the model engine computes for real")
    if source is None and preset not in FAMILIES:
        raise ConfigError(
            f"--engine model runs model code, and preset {preset!r} is a geometry only; "
            f"use one of: {', '.join(FAMILIES)}"
        )
    if importlib.util.find_spec("transformers") is None:  # not imported here: offline switches first
        raise ConfigError("--engine model needs transformers: pip install 'disagg[model]'")
    from disagg.engine.model.engine import TransformersEngine

    return TransformersEngine(source or preset, device, prefill_chunk=prefill_chunk)


ENGINES: dict[str, Callable[..., "ModelEngine"]] = {"standin": _standin, "model": _model}
CHOICES = ("auto", *ENGINES)


def resolve(name: str, preset: str, source: ModelSource | None = None) -> str:
    return ("model" if source is not None or preset in FAMILIES else "standin") if name == "auto" else name


def create(
    name: str,
    preset: str,
    device: str,
    simulate_layer_ms: float = 0.0,
    source: ModelSource | None = None,
    *,
    prefill_chunk: int | None = None,
) -> "ModelEngine":
    """The engine `name` (or auto) for `preset` or `source` (--model, --model-type), its model
    on `device` (a resolved device); `prefill_chunk`: the model engine's tokens per prefill
    pass (None: the family's)."""
    return ENGINES[resolve(name, preset, source)](
        preset, device, simulate_layer_ms, source, prefill_chunk=prefill_chunk
    )
