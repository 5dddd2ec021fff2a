"""Loading Hugging Face causal LMs, their embedding / head matrices and transformer blocks. (Their tokenizers, the
bytes of each token and the source-token ids S2T2 translates from: data/tokenizers.py.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from s2t2_dist.errors import ConfigError
from s2t2_dist.errors import UnsupportedModel, ModelLoadError

ASSETS = Path(__file__).resolve().parent.parent / "assets"

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def _tensor_groups(keys: list[str], shown: int = 3) -> str:
    """`model.layers.2-31 (270 tensors), lm_head.weight`: numbered blocks folded into ranges."""
    import re

    groups: dict[str, set[int]] = {}
    counts: dict[str, int] = {}
    for k in keys:
        m = re.match(r"^(.*?\.)(\d+)\.", k)
        head = m.group(1) if m else k
        groups.setdefault(head, set())
        counts[head] = counts.get(head, 0) + 1
        if m:
            groups[head].add(int(m.group(2)))
    parts = []
    for head, idx in groups.items():
        if idx:
            lo, hi = min(idx), max(idx)
            rng = f"{lo}-{hi}" if len(idx) == hi - lo + 1 and hi > lo else ",".join(map(str, sorted(idx)[:6]))
            parts.append(f"{head}{rng} ({counts[head]} tensors)")
        else:
            parts.append(head)
    more = f", ... ({len(parts) - shown} more)" if len(parts) > shown else ""
    return ", ".join(parts[:shown]) + more


def check_loading_info(path: str | os.PathLike, info: dict) -> None:
    """After `from_pretrained(..., output_loading_info=True)`: every tensor the model needs came from the weights
    and every tensor of the weights was used, else ModelLoadError (transformers only prints a load report and
    initialises the missing ones at random)."""
    missing, unexpected = list(info.get("missing_keys") or []), list(info.get("unexpected_keys") or [])
    mismatched = list(info.get("mismatched_keys") or [])
    if not (missing or unexpected or mismatched):
        return
    said = []
    if missing:
        said.append(f"{len(missing)} tensors the model needs are not in the weights ({_tensor_groups(missing)})")
    if unexpected:
        said.append(f"{len(unexpected)} tensors of the weights are not used by the model "
                    f"({_tensor_groups(unexpected)})")
    if mismatched:
        names = [m[0] if isinstance(m, (tuple, list)) else str(m) for m in mismatched]
        said.append(f"{len(names)} tensors have other shapes than config.json gives ({_tensor_groups(names)})")
    raise ModelLoadError(f"model.path {path}: the weights do not match config.json: {'; '.join(said)}; the model "
                         "would run with random parts (is config.json the one saved with these weights?)")


def from_pretrained_checked(path: str | os.PathLike, **kwargs: Any):
    """`AutoModelForCausalLM.from_pretrained(path, **kwargs)` that refuses a model that loads wrong
    (`check_loading_info`; a shape mismatch transformers raises on is said in one line too)."""
    from transformers import AutoModelForCausalLM

    try:
        model, info = AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True, **kwargs)
    except RuntimeError as e:
        if "ignore_mismatched_sizes" not in str(e) and "size mismatch" not in str(e):
            raise
        raise ModelLoadError(f"model.path {path}: tensor shapes in the weights differ from what config.json "
                             "describes (transformers' load report above lists them); is config.json the one "
                             "saved with these weights?") from None
    check_loading_info(path, info)
    return model


def asset_path(*parts: str) -> Path:
    """Path of a file shipped in `s2t2_dist/assets/` (raises FileNotFoundError naming it if missing)."""
    p = ASSETS.joinpath(*parts)
    if not p.exists():
        raise FileNotFoundError(f"shipped asset not found: {p} (is the package installed with its data files?)")
    return p


def torch_dtype(dtype: str | torch.dtype | None) -> torch.dtype | str | None:
    """A dtype's name (`"float32"`/`"bf16"`/...) or a torch.dtype -> torch.dtype; `"auto"` and None are passed
    through. (The compute dtype of a run, from train.precision and the device, is stages.common.compute_dtype.)"""
    if dtype is None or isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    key = str(dtype).lower().replace("torch.", "")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[key]


def _dtype_kwarg() -> str:
    """transformers >= 4.56 takes `dtype=`, older versions `torch_dtype=`."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    """requires_grad=False on every parameter and eval mode (no dropout). Returns the model."""
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def load_causal_lm(
    path_or_id: str | os.PathLike,
    dtype: str | torch.dtype | None = "float32",
    device: str | torch.device | None = "cpu",
    trust_remote_code: bool = False,
    frozen: bool = False,
    **kwargs: Any,
):
    """`AutoModelForCausalLM.from_pretrained(path_or_id)` in `dtype` on `device`.

    `frozen=True` freezes every parameter (the S2T2 translation stage trains only the translator). Extra keyword
    arguments go to `from_pretrained` (e.g. `device_map`, `revision`, `attn_implementation`); with `device_map`,
    `device` is ignored.
    """
    if dtype is not None:
        kwargs[_dtype_kwarg()] = torch_dtype(dtype)
    model = from_pretrained_checked(path_or_id, trust_remote_code=trust_remote_code, **kwargs)
    if device is not None and "device_map" not in kwargs:
        model = model.to(device)
    return freeze(model) if frozen else model


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each transformer block's activations in backward (HF gradient checkpointing, non-reentrant: the
    gradient reaches inputs that need it through a frozen body). The one setup of both stages and every engine.
    HF checkpoints only in training mode: a caller whose model stays in eval mode must switch it to train()."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise ConfigError(f"activation checkpointing needs a transformers model; {type(model).__name__} has no "
                          "gradient_checkpointing_enable")


def build_causal_lm(source, *, dtype: torch.dtype | None = None, device: str | torch.device | None = None,
                    seed: int = 0, trust_remote_code: bool = False) -> torch.nn.Module:
    """A causal LM from a model directory / hub id (`load_causal_lm`), a transformers PretrainedConfig (random init,
    seeded) or an nn.Module (returned as it is); `dtype` None: float32; `device` None: where it was built."""
    if isinstance(source, torch.nn.Module):
        return source
    from transformers import AutoModelForCausalLM, PretrainedConfig

    if isinstance(source, PretrainedConfig):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(source)
        return model.to(device) if device is not None else model
    return load_causal_lm(source, dtype=dtype or torch.float32, device=device, trust_remote_code=trust_remote_code)


def get_embedding_and_head(model) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(E, L, tied): the input embedding matrix [V, d], the output head matrix [V, d] and whether they share storage.

    V is the number of embedding ROWS (possibly padded beyond the tokenizer's vocabulary). Works for tied models
    (OLMo-1B, Llama with tie_word_embeddings) and untied ones (OLMo-7B).
    """
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    name = type(model).__name__
    if emb is None or head is None:
        raise UnsupportedModel(f"{name} has no input embeddings or no output head")
    if getattr(head, "bias", None) is not None:
        raise UnsupportedModel(f"{name}'s output head has a bias; S2T2 translates the head's weights only "
                               "(L' = W^T L) and has no translation for a per-token bias")
    E, L = getattr(emb, "weight", None), getattr(head, "weight", None)
    if not isinstance(E, torch.Tensor) or not isinstance(L, torch.Tensor) or E.dim() != 2:
        raise UnsupportedModel(f"{name}'s input embedding or output head is not one [V, d] weight matrix")
    if E.shape != L.shape:
        raise UnsupportedModel(f"{name}: embedding {tuple(E.shape)} and head {tuple(L.shape)} shapes differ")
    tied = E is L or (E.data_ptr() == L.data_ptr() and E.stride() == L.stride())
    return E, L, tied


@torch.no_grad()
def check_finite_embeddings(E: torch.Tensor, L: torch.Tensor, where: str, chunk: int = 8192) -> None:
    """Refuse (ModelLoadError) an input embedding or output head holding a NaN or infinite value in any row, read
    by this run or not: such weights are damaged (a row no source token reads today is read by another vocabulary,
    a finetune or an export). By blocks of ``chunk`` rows (no [V, d] temporary)."""
    for name, W in (("input embedding", E),) + ((("output head", L),) if L is not E else ()):
        bad = torch.cat([~torch.isfinite(W[i:i + chunk]).all(1) for i in range(0, W.shape[0], chunk)])
        n = int(bad.sum())
        if n:
            ids = bad.nonzero().flatten()[:5].tolist()
            raise ModelLoadError(f"{where}: {n} row(s) of the {name} hold NaN or infinite values (ids "
                                 f"{', '.join(map(str, ids))}{', ...' if n > 5 else ''}): the weights are damaged or "
                                 "come from a diverged run")


# ----------------------------------------------------------------------------------------------------------------
# blocks and parameters


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks to shard one by one: the classes a transformers model lists in `_no_split_modules`
    (e.g. OlmoDecoderLayer), else the children of a ModuleList called layers / h / blocks."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if blocks:
        return blocks
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.ModuleList) and name.split(".")[-1] in ("layers", "h", "blocks"):
            return list(m)
    raise ValueError(f"cannot find the transformer blocks of {type(model).__name__}")


def fully_shard_blocks(model: torch.nn.Module, **kwargs: Any) -> int:
    """FSDP2's `fully_shard` on each transformer block alone (the rest of the model stays whole on every rank);
    returns the number of blocks. Collective: every rank of the default process group."""
    try:  # torch >= 2.6
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # pragma: no cover - torch 2.4/2.5
        from torch.distributed._composable.fsdp import fully_shard

    blocks = transformer_blocks(model)
    for block in blocks:
        fully_shard(block, **kwargs)
    return len(blocks)


def local_numel(model: torch.nn.Module) -> tuple[int, int]:
    """(elements this rank holds, elements of the whole model)."""
    local = total = 0
    for p in model.parameters():
        if hasattr(p, "to_local"):
            local += p.to_local().numel()
        else:
            local += p.numel()
        total += p.numel()
    return local, total


@dataclass
class ModelPathConfig:
    """The `model:` section of every stage (translate extends it): a Hugging Face model directory or hub id
    (translate, finetune: the source model; evaluate: the model evaluated, or the source model a P file is applied
    to). Finetuning keeps float32 master weights (train.precision selects bf16 compute): no dtype key."""

    #: a Hugging Face model directory or hub id (translate, finetune: the source model; evaluate: the model
    #: evaluated, or the source model a P file is applied to)
    path: str = ""
    #: let transformers run the model repository's own Python code (models not built into transformers)
    trust_remote_code: bool = False

    def validate(self) -> None:
        if not self.path:
            raise ConfigError("path: the model (a Hugging Face directory or hub id) is required")
