"""A model directory's config.json against its architecture and its weights, from files only (config.json and the
safetensors headers, no tensor read): what would otherwise load silently wrong.

- A field the architecture needs and config.json lacks (``num_hidden_layers``, ``hidden_size``, ``vocab_size``, the
  norm epsilon, ...) would be filled with the class default: a 2-layer model would load as 32 layers, 30 of them
  random; a model trained with rms_norm_eps=1e-5 would run with 1e-6. Refused, naming the field.
- Depth, width and vocabulary in config.json must match the weights (the embedding's shape, the highest block
  number), checked on the safetensors headers before any model is built (a config of vocab 32000 x width 4096
  would otherwise allocate that much before failing).

The stages call :func:`check` in their pre-flight (stages/checks.model_dir); after loading, models/hf.py checks
transformers' loading info (missing / unused tensors) as well.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

from s2t2_dist.errors import ConfigError

#: fields whose class default would silently change the model (shapes, or numerics like the norm epsilon); each is
#: required when the architecture's config class takes it (by this name or its attribute_map alias)
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
            "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps")
_EMBED = re.compile(r"(?:^|\.)(?:embed_tokens|wte|embed_in|word_embeddings|tok_embeddings)\.weight$")
_BLOCK = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")


def _config_class(model_type: str):
    try:
        from transformers import CONFIG_MAPPING
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    try:
        return CONFIG_MAPPING[model_type]
    except KeyError:
        return None  # custom code (trust_remote_code) or an unknown type: transformers says so itself


def _takes(cls) -> set[str]:
    import inspect

    names = set(inspect.signature(cls.__init__).parameters)
    for c in cls.__mro__:
        names |= set(getattr(c, "__annotations__", {}))
    return names


def missing_fields(cfg: dict) -> list[str]:
    """The REQUIRED fields the config class of cfg["model_type"] takes and cfg lacks (under either name)."""
    cls = _config_class(str(cfg.get("model_type", "")))
    if cls is None:
        return []
    takes, alias = _takes(cls), dict(getattr(cls, "attribute_map", {}) or {})
    out = []
    for field in REQUIRED:
        name = alias.get(field, field)
        if name in takes and field not in cfg and name not in cfg:
            out.append(name)
    return out


def _safetensors_shapes(directory: Path) -> dict[str, list[int]] | None:
    """Tensor name -> shape from the headers of model.safetensors or the shards its index names; None if the
    weights are in another format."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
    elif (directory / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        return None
    shapes: dict[str, list[int]] = {}
    for name in files:
        try:
            with open(directory / name, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
        except (OSError, ValueError, struct.error) as e:
            raise ConfigError(f"model.path {directory}: {name} is not a readable safetensors file ({e})") from None
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    return shapes


def check(directory: Path, key: str = "model.path") -> None:
    cfg_path = directory / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}: {cfg_path}: unreadable ({e})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{key}: {cfg_path} is not a JSON object")
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    if "model_type" not in text and "model_type" in cfg:
        text = {**text, "model_type": cfg["model_type"]}
    gone = missing_fields(text)
    if gone:
        raise ConfigError(f"{key}: {cfg_path} lacks {', '.join(gone)}, which the {text.get('model_type')} "
                          "architecture needs (transformers would use its class default and load a different "
                          "model); restore the config.json saved with these weights")
    shapes = _safetensors_shapes(directory)
    if not shapes:
        return
    cls = _config_class(str(text.get("model_type", "")))
    alias = dict(getattr(cls, "attribute_map", {}) or {}) if cls is not None else {}

    def value(field):
        return text.get(field, text.get(alias.get(field, field)))

    emb = [s for k, s in shapes.items() if _EMBED.search(k) and len(s) == 2]
    said = []
    if emb:
        rows, width = emb[0]
        if isinstance(value("vocab_size"), int) and value("vocab_size") != rows:
            said.append(f"vocab_size={value('vocab_size')} but the embedding has {rows} rows")
        if isinstance(value("hidden_size"), int) and value("hidden_size") != width:
            said.append(f"{alias.get('hidden_size', 'hidden_size')}={value('hidden_size')} but the embedding is "
                        f"{width} wide")
    blocks = {int(m.group(1)) for k in shapes for m in [_BLOCK.search(k)] if m}
    depth = value("num_hidden_layers")
    if blocks and isinstance(depth, int) and depth != max(blocks) + 1:
        said.append(f"{alias.get('num_hidden_layers', 'num_hidden_layers')}={depth} but the weights hold "
                    f"{max(blocks) + 1} layers")
    if said:
        raise ConfigError(f"{key}: {cfg_path} does not describe the weights beside it: {'; '.join(said)}; "
                          "restore the config.json saved with these weights")
