"""Where the model engine's model comes from, and what identifies it to the other side.

    --preset tiny-model-*              a family of ours (families.py): config in code, seeded random weights
    --model PATH                       a local HuggingFace model directory (config.json + *.safetensors),
                                       loaded by transformers offline (local_files_only: nothing is fetched)
    --model-type T --model-config J    transformers' model type T with the config J (a JSON object),
                                       seeded random weights: any family transformers ships, no code here

The pool geometry is read off the loaded model's cache either way (geometry.py), so a model
type whose cache layers are of kinds the pool holds runs without a change here.

Both sides must hold the same model, not only the same geometry: two checkpoints of one
architecture have identical pools and different outputs. `identity` is the model's config
hash (its config as JSON, less the fields that name where it was loaded from) and a weights
fingerprint (every parameter's name, shape, dtype and an evenly strided sample of at most
4096 of its values, hashed): cheap on a model of any size, and a fine-tune or another seed
changes nearly every value. Each side sends both in its layout description and registration
is refused where they differ (disagg/control/layout.py).
"""

import hashlib
import json
import os
from dataclasses import dataclass

from disagg.errors import ConfigError
from disagg.engine.model.families import Family, go_offline

DTYPES = ("auto", "float32", "bfloat16", "float16")
SAMPLE = 4096  # values per parameter the fingerprint reads
VOLATILE = (
    "_name_or_path",
    "transformers_version",
    "dtype",
    "torch_dtype",
    "_attn_implementation_internal",
    "_commit_hash",
    "architectures",
)
# model types whose code applies sparse masks only under plain "eager" attention (attention.py)
PLAIN_EAGER = ("deepseek_v32",)


@dataclass(frozen=True)
class ModelSource:
    """A model from outside our family list: a directory, or a model type and its config."""

    path: str | None = None
    model_type: str | None = None
    config_json: str | None = None
    dtype: str = "auto"
    page_size: int = 16

    def __post_init__(self) -> None:
        if (self.path is None) == (self.model_type is None):
            raise ConfigError("give either --model PATH or --model-type TYPE (with --model-config JSON), not both")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r}: choose from {', '.join(DTYPES)}")
        if self.path is not None:
            if self.config_json is not None:
                raise ConfigError("--model-config goes with --model-type; a --model directory has its config.json")
            if not os.path.isfile(os.path.join(self.path, "config.json")):
                raise ConfigError(f"--model {self.path}: not a model directory (no config.json in it)")
        else:
            self.config()  # a bad JSON is refused when the flags are read

    @property
    def name(self) -> str:
        if self.path is not None:
            return os.path.basename(os.path.normpath(self.path)) or "model"
        return f"{self.model_type}-random"

    def config(self) -> dict:
        """The config as a dict (config.json, or --model-config), without importing transformers."""
        if self.path is not None:
            with open(os.path.join(self.path, "config.json")) as f:
                return json.load(f)
        try:
            config = json.loads(self.config_json or "{}")
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--model-config is not JSON: {exc}") from None
        if not isinstance(config, dict):
            raise ConfigError("--model-config must be a JSON object of config fields")
        return config

    @property
    def vocab_size(self) -> int | None:
        config = self.config()
        size = config.get("vocab_size", config.get("text_config", {}).get("vocab_size"))
        return size if isinstance(size, int) else None

    def family(self) -> Family:
        """--model-type: a family made of the flags (random weights, no directory)."""
        return Family(
            self.name,
            self.model_type,
            self.config(),
            page_size=self.page_size,
            dtype="float32" if self.dtype == "auto" else self.dtype,
            chunked_attention=self.model_type not in PLAIN_EAGER,
            tiny=False,
        )


def load_directory(source: ModelSource, device: str, attn_impl) -> tuple:
    """(config, model) of a --model directory, offline, safetensors only. `attn_impl(model_type)`
    names the attention implementation for that model type."""
    go_offline()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(source.path, local_files_only=True)
        dtype = "auto" if source.dtype == "auto" else getattr(torch, source.dtype)
        model = AutoModelForCausalLM.from_pretrained(
            source.path,
            config=config,
            local_files_only=True,
            use_safetensors=True,
            dtype=dtype,
            attn_implementation=attn_impl(config.model_type),
        )
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"--model {source.path}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}") from None
    return config, model.to(device)


def config_hash(config) -> str:
    fields = {k: v for k, v in config.to_dict().items() if k not in VOLATILE}
    text = json.dumps(fields, sort_keys=True, default=str)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:32]


def weights_fingerprint(model) -> str:
    import torch

    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        flat = p.detach().reshape(-1)
        step = max(1, flat.numel() // SAMPLE)
        sample = flat[::step][:SAMPLE].contiguous().cpu()
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}:".encode())
        h.update(sample.view(torch.uint8).numpy().tobytes())  # (bytes: bf16 has no numpy dtype)
    return "sha256:" + h.hexdigest()[:32]
