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
import os
import re
import struct
from pathlib import Path

from s2t2_dist.errors import ConfigError
from s2t2_dist.utils.io import not_a_file

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


#: bytes per element of the safetensors dtypes (a dtype not listed: its size is not checked)
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
             "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
#: the safetensors library refuses headers above 100 MB; a larger length is garbage in the first 8 bytes
MAX_HEADER = 100_000_000


def _bad(key: str, path: Path, why: str) -> ConfigError:
    return ConfigError(f"{key}: {path} is not a usable safetensors file: {why}; restore the weights saved with this "
                       "model")


def _tensor_bytes(name: str, v, data_len: int, key: str, path: Path) -> int:
    """One header entry checked against the data section; returns where its bytes end."""
    try:
        dtype, shape, (b, e) = v["dtype"], [int(x) for x in v["shape"]], [int(x) for x in v["data_offsets"]]
    except (TypeError, KeyError, ValueError):
        raise _bad(key, path, f"the header entry of {name} is malformed") from None
    if not 0 <= b <= e:
        raise _bad(key, path, f"{name} has data offsets [{b}, {e}]")
    if e > data_len:
        raise _bad(key, path, f"truncated: {name} ends at byte {e:,} of the data but the file holds only "
                              f"{data_len:,} bytes after its header")
    n = 1
    for d in shape:
        n *= d
    if dtype in _ITEMSIZE and e - b != n * _ITEMSIZE[dtype]:
        raise _bad(key, path, f"{name} ({dtype} {shape}) should take {n * _ITEMSIZE[dtype]:,} bytes, its offsets "
                              f"give {e - b:,}")
    return e


def read_header(path: Path, key: str = "model.path") -> dict:
    """The header of a safetensors file, checked against the file: a regular file, the header length within the file,
    JSON, every tensor's offsets inside the data section and of its dtype x shape size. Reads the header only."""
    what = not_a_file(path)
    if what:
        raise ConfigError(f"{key}: {path} is {what}, not a weights file" if what.startswith("a ")
                          else f"{key}: {path} {what}")
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _bad(key, path, f"it holds {len(head)} bytes")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, MAX_HEADER):  # garbage in the first 8 bytes: never read that many
                raise _bad(key, path, f"its first 8 bytes give a header of {n:,} bytes in a file of {size:,} "
                                      "(damaged, or not a safetensors file)")
            header = json.loads(f.read(n))
    except OSError as e:
        raise ConfigError(f"{key}: {path}: cannot be read ({e.strerror or e})") from None
    except ConfigError:  # the header length already judged above (a ConfigError is a ValueError too)
        raise
    except (ValueError, UnicodeDecodeError) as e:
        raise _bad(key, path, f"its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise _bad(key, path, "its header is not a JSON object")
    data_len = size - 8 - n
    ends = [_tensor_bytes(k, v, data_len, key, path) for k, v in header.items() if k != "__metadata__"]
    if ends and max(ends) < data_len:  # safetensors refuses bytes no tensor covers
        raise _bad(key, path, f"{data_len - max(ends):,} bytes after the last tensor")
    return header


def _weight_files(directory: Path, key: str) -> list[str] | None:
    """The safetensors files of a model directory (the index's shards, or model.safetensors); None when the weights
    are in another format."""
    index = directory / "model.safetensors.index.json"
    single = directory / "model.safetensors"
    if index.exists():
        try:
            return sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        except (OSError, ValueError, AttributeError) as e:
            raise ConfigError(f"{key}: {index}: unreadable ({e})") from None
    if os.path.lexists(single):
        return ["model.safetensors"]
    return None


def _safetensors_shapes(directory: Path, key: str = "model.path") -> dict[str, list[int]] | None:
    """Tensor name -> shape from the checked headers of model.safetensors or the shards its index names; None if the
    weights are in another format."""
    files = _weight_files(directory, key)
    if files is None:
        return None
    shapes: dict[str, list[int]] = {}
    for name in files:
        header = read_header(directory / name, key)
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    return shapes


def _known_architecture(cfg: dict, text: dict, cfg_path: Path, key: str) -> None:
    """A model_type this transformers does not know is one line here, not AutoConfig's traceback; a model with its
    own code (auto_map, trust_remote_code) is transformers' business."""
    if "auto_map" in cfg:
        return
    mt = cfg.get("model_type", text.get("model_type"))
    if not isinstance(mt, str) or not mt:
        raise ConfigError(f"{key}: {cfg_path} names no model_type, so no architecture can be chosen; restore the "
                          "config.json saved with these weights")
    if _config_class(mt) is None:
        import transformers

        raise ConfigError(f"{key}: {cfg_path}: model_type {mt!r} is not an architecture transformers "
                          f"{transformers.__version__} knows (a newer transformers, or a model with its own code "
                          "and model.trust_remote_code=true?)")


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
    _known_architecture(cfg, text, cfg_path, key)
    shapes = _safetensors_shapes(directory, key)
    verify_record(directory, key)
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


#: the checksums of a model directory s2t2 wrote (finetune's export, the source-model cache): its weight files,
#: tokenizer.json and config.json, by size and sha256; a stage reading the directory compares them before any weight
#: is read
RECORD = "s2t2_weights.json"


def _recorded_files(directory: Path) -> list[str]:
    files = _weight_files(directory, "model directory") or []
    extra = ["model.safetensors.index.json", "tokenizer.json", "config.json"]
    return [*files, *[f for f in extra if (directory / f).is_file()]]


def write_record(directory: Path) -> dict:
    """Record the size and sha256 of the weight files and tokenizer.json of ``directory`` in RECORD."""
    from s2t2_dist.utils.io import atomic_write_json, sha256_file

    files = {name: {"bytes": (directory / name).stat().st_size, "sha256": sha256_file(directory / name)}
             for name in _recorded_files(Path(directory))}
    record = {"files": files}
    atomic_write_json(Path(directory) / RECORD, record)
    return record


def recorded(directory: Path) -> dict | None:
    """{file: {bytes, sha256}} recorded for ``directory``: RECORD, or the weights_sha256 of a source-model cache built
    before RECORD existed; None when nothing was recorded (a model s2t2 did not write)."""
    directory = Path(directory)
    try:
        return dict(json.loads((directory / RECORD).read_text())["files"])
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"model.path: {directory / RECORD}: unreadable ({e}); the directory's checksums cannot be "
                          "compared") from None
    try:  # the smollm2 cache's own record (recipes/smollm2.py)
        info = json.loads((directory / "smollm2_source.json").read_text())
        return {"model.safetensors": {"sha256": info["weights_sha256"]}}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def verify_record(directory: Path, key: str = "model.path") -> None:
    """The files of a directory s2t2 wrote are the ones it wrote: each recorded file present, of its size and sha256
    (a weights file cut short, overwritten in the middle, or a tokenizer.json of another model). Nothing recorded:
    nothing to compare (the structural checks of `check` still apply)."""
    from s2t2_dist.utils.io import sha256_file

    files = recorded(directory)
    for name, want in sorted((files or {}).items()):
        path = Path(directory) / name
        what = not_a_file(path)
        if what:
            raise ConfigError(f"{key}: {path} {what if not what.startswith('a ') else 'is ' + what}, but s2t2 wrote a "
                              f"file there (recorded in {RECORD}); restore or rebuild the model")
        size = path.stat().st_size
        if "bytes" in want and size != want["bytes"]:
            raise ConfigError(f"{key}: {path} has {size:,} bytes but s2t2 wrote {want['bytes']:,} there: damaged or "
                              "replaced; restore or rebuild the model")
        got = sha256_file(path)
        if got != want.get("sha256"):
            raise ConfigError(f"{key}: {path} is not the file s2t2 wrote there (sha256 {got[:16]}..., recorded "
                              f"{str(want.get('sha256'))[:16]}...): damaged or replaced; restore or rebuild the model")
