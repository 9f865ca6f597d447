"""Input validation of a dense model, the one every conversion engine runs (native streaming, split streaming, in
memory): config.json against the safetensors weights (layer counts, missing and unexpected tensors, shapes), checked
from the headers before any weight is read, and finite weights, checked as each tensor is read.

A mismatch means config.json does not describe the weights: converting anyway would drop layers, or build layers and
tensors with random weights, so every engine refuses it the same way.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from moecompile.core.errors import MoECompileError
from moecompile.io.checkpoint import WEIGHTS_INDEX, tensor_headers, weight_files
from moecompile.io.stream import read_tensor

IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")  # a buffer some old checkpoints stored: recomputed on load
LIST_RE = re.compile(r"^(.*?)\.(\d+)\.")  # a tensor's first numbered module list: (its path, the index)
NONFINITE_HINT = "allow_nonfinite=True (--allow-nonfinite) converts it anyway"  # in API terms and the CLI's


def source_tensors(directory: Path) -> dict[str, tuple[Path, tuple, str]]:
    """name -> (file, shape, safetensors dtype) of every tensor of a checkpoint folder, from the headers alone. A
    tensor IGNORED matches is neither checked nor written."""
    tensors = {k: v for k, v in tensor_headers(weight_files(directory)).items() if not IGNORED.search(k)}
    index = directory / WEIGHTS_INDEX
    if index.is_file():  # weight_files checked that it parses
        lost = [k for k, f in json.loads(index.read_text())["weight_map"].items()
                if not IGNORED.search(k) and (k not in tensors or tensors[k][0].name != f)]
        if lost:
            raise MoECompileError(f"{index.name} names {len(lost)} tensors its files do not hold, e.g. {lost[0]}")
    return tensors


def _meta_model(directory: Path, model_class):
    """The model config.json describes, built on the meta device (no memory, whatever its size), and its config."""
    import transformers

    try:
        hf_config = transformers.AutoConfig.from_pretrained(directory)  # config.json only
        with torch.device("meta"):
            model = (model_class.from_config(hf_config) if model_class.__name__.startswith("Auto")
                     else model_class(hf_config))
    except Exception as e:  # noqa: BLE001 - any failure here means config.json does not describe a buildable model
        raise MoECompileError(f"{directory}: cannot build {model_class.__name__} from config.json: {e}") from None
    return model, hf_config


def _as_loaded(stored: list[str], expected: set[str], prefix: str) -> dict[str, str]:
    """stored name -> the name it fills in the model: transformers adds or strips the base model's prefix when a
    base model's checkpoint loads into a model with a head, or the reverse."""
    if not prefix:
        return {k: k for k in stored}
    dotted = prefix + "."
    has = any(k.startswith(dotted) for k in stored)
    wants = any(k.startswith(dotted) for k in expected)
    if wants and not has:
        return {k: dotted + k for k in stored}
    if has and not wants:
        return {k: k.removeprefix(dotted) for k in stored}
    return {k: k for k in stored}


def _layer_lists(names) -> dict[str, set[int]]:
    lists: dict[str, set[int]] = {}
    for name in names:
        if m := LIST_RE.match(name):
            lists.setdefault(m.group(1), set()).add(int(m.group(2)))
    return lists


def _span(indices: set[int]) -> str:
    if not indices:
        return "no layers"
    low, high = min(indices), max(indices)
    gaps = "" if len(indices) == high - low + 1 else f" ({len(indices)} of them)"
    return f"layers {low}-{high}{gaps}" if high > low else f"layer {low}"


def _renamed_on_load(model) -> bool:
    """Whether transformers converts this model's checkpoint names on load (e.g. per-expert MoE weights into fused
    ones): the stored names are then not the model's."""
    try:
        from transformers.conversion_mapping import extract_weight_conversions_for_model
    except ImportError:
        return False
    return bool(extract_weight_conversions_for_model(model))


def check_tensors(directory: Path, tensors: dict[str, tuple[Path, tuple, str]], model_class) -> None:
    """The weights (name -> (file, shape, dtype), from the headers) hold exactly the tensors that config.json implies
    for model_class: every numbered layer list complete, nothing missing (a tied weight may be stored once), nothing
    unexpected, every shape right. Raises MoECompileError naming the first mismatch."""
    model, hf_config = _meta_model(directory, model_class)
    state = model.state_dict()
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = {k: tuple(t.shape) for k, t in state.items()}
    loaded = _as_loaded(list(tensors), set(expected), getattr(model, "base_model_prefix", ""))
    ignore = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    transient = {n for n, _ in model.named_buffers() if n not in state}  # non-persistent buffers old files stored
    stored = {loaded[k]: v for k, v in tensors.items()
              if loaded[k] in expected or not (loaded[k] in transient or any(p.search(loaded[k]) for p in ignore))}
    n = getattr(hf_config, "num_hidden_layers", None)
    key = getattr(hf_config, "attribute_map", {}).get("num_hidden_layers", "num_hidden_layers")
    present = _layer_lists(stored)
    for path, indices in _layer_lists(expected).items():
        if present.get(path, set()) != indices:
            says = (f"{key}={n}" if len(indices) == n else f"{len(indices)} entries of {path}")
            raise MoECompileError(f"{directory}: config.json says {says} but the weights hold "
                                  f"{_span(present.get(path, set()))}")
    tied = {id(p): [k for k, q in params.items() if q is p] for p in params.values()}  # one tensor, several names
    if _renamed_on_load(model):
        return  # transformers renames (and fuses) these names on load, and reports what is left over itself
    missing = [k for k in expected if k not in stored
               and not (k in params and any(other in stored for other in tied[id(params[k])]))]
    if missing:
        raise MoECompileError(f"{directory}: {len(missing)} tensors missing from the weights, e.g. {missing[0]}")
    unexpected = [k for k in stored if k not in expected]
    if unexpected:
        raise MoECompileError(f"{directory}: unexpected tensor {unexpected[0]} for {type(model).__name__} "
                              f"({len(unexpected)} in all)")
    for k, (_, shape, _) in stored.items():
        if shape != expected[k]:
            raise MoECompileError(f"{directory}: {k} has shape {shape}, config.json implies {expected[k]}")


def check_folder(directory: Path, model_class) -> dict[str, tuple[Path, tuple, str]]:
    """source_tensors, checked against config.json (check_tensors); returns them."""
    tensors = source_tensors(directory)
    check_tensors(directory, tensors, model_class)
    return tensors


def check_finite(name: str, value: torch.Tensor, allow: bool = False) -> torch.Tensor:
    """value, refused when it holds NaN or infinity (unless allow): a conversion would spread them silently."""
    if allow or not value.is_floating_point() or value.numel() == 0:
        return value
    wide = value if value.element_size() > 1 else value.to(torch.float16)  # isfinite has no FP8 kernel
    if not bool(torch.isfinite(wide).all()):
        bad = int((~torch.isfinite(wide)).sum())
        raise MoECompileError(f"{name} holds {bad} NaN or infinite values of {value.numel()}: not a usable model "
                              f"({NONFINITE_HINT})")
    return value


def read_checked(path: Path, name: str, allow_nonfinite: bool = False) -> torch.Tensor:
    """One source tensor, read and checked finite (the streaming engines read every weight through here)."""
    return check_finite(name, read_tensor(path, name), allow_nonfinite)


def check_model_finite(model: torch.nn.Module, allow: bool = False) -> None:
    """Every parameter and buffer of a model built in memory checked finite (check_finite)."""
    if allow:
        return
    for name, value in model.state_dict().items():
        check_finite(name, value)
