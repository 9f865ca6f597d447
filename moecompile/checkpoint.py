"""Checkpoints: an HF-style folder (config.json with an `moe` section, safetensors weights, tokenizer files).

save() writes into a temporary sibling folder and renames it into place at the end, so a failed or interrupted
run leaves no directory behind. load() builds the model from config.json alone (no pickle, no remote code),
puts MoEBlocks where the `moe` section says, and fills every tensor from the safetensors files, refusing files
that are corrupt or do not fit the config.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_model
from torch import nn
from tqdm.auto import tqdm

from . import layout
from .errors import MoECompileError

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja")
DEFAULT_SHARD_SIZE = "5GB"


def check_output_dir(directory: str | os.PathLike) -> Path:
    """Refuse an existing non-empty output directory before any work is done."""
    directory = Path(directory)
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise MoECompileError(f"output directory {directory} exists and is not empty")
    return directory


def is_checkpoint(directory: str | os.PathLike) -> bool:
    path = Path(directory) / CONFIG
    if not path.is_file():
        return False
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(config, dict) and "moe" in config


def save(model: nn.Module, directory: str | os.PathLike, tokenizer_dir: str | os.PathLike | None = None,
         max_shard_size: str | int = DEFAULT_SHARD_SIZE, progress: bool = True,
         extra_files: dict[str, bytes] | None = None) -> Path:
    """Write model (converted by moeize) to directory, atomically; extra_files (name -> bytes, e.g. a
    calibration report) are written beside the weights inside the same atomic step."""
    directory = check_output_dir(directory)
    blocks = layout.get_layout(model)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", suffix=".partial", dir=directory.parent))
    try:
        with tqdm(total=3, desc="save", unit="step", disable=not progress) as bar:
            if hasattr(model, "save_pretrained"):  # HF: config, tied weights, sharding and index
                from transformers.utils import logging as hf_logging

                bars = hf_logging.is_progress_bar_enabled()
                if not progress:  # transformers' own "Writing model shards" bar
                    hf_logging.disable_progress_bar()
                try:
                    model.save_pretrained(tmp, max_shard_size=max_shard_size)
                finally:
                    if bars and not progress:
                        hf_logging.enable_progress_bar()
                config = json.loads((tmp / CONFIG).read_text())
            else:
                save_model(model, str(tmp / WEIGHTS))
                config = {}
            bar.update()
            config["moe"] = {"format_version": layout.FORMAT_VERSION, "blocks": blocks}
            (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            bar.update()
            if tokenizer_dir is not None:
                for name in TOKENIZER_FILES:
                    if (Path(tokenizer_dir) / name).is_file():
                        shutil.copy2(Path(tokenizer_dir) / name, tmp / name)
            for name, data in (extra_files or {}).items():
                (tmp / name).write_bytes(data)
            bar.update()
        _default_permissions(tmp)
        if directory.exists():
            directory.rmdir()  # empty, checked above
        os.rename(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def _default_permissions(folder: Path) -> None:
    """mkdtemp makes a private folder; give the result the permissions a plain mkdir/open would."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for f in folder.iterdir():
        os.chmod(f, 0o666 & ~umask)


def _read_config(directory: Path) -> dict:
    path = directory / CONFIG
    if not path.is_file():
        raise MoECompileError(f"{directory} is not a checkpoint: no {CONFIG}")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MoECompileError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise MoECompileError(f"{path} is not a JSON object")
    return config


def weight_files(directory: Path) -> list[Path]:
    index = directory / WEIGHTS_INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError, TypeError) as e:
            raise MoECompileError(f"{index} is not a valid safetensors index: {e}") from None
        return [directory / n for n in names]
    if (directory / WEIGHTS).is_file():
        return [directory / WEIGHTS]
    raise MoECompileError(f"no safetensors weights in {directory} ({WEIGHTS} or {WEIGHTS_INDEX})")


def read_tensors(files: list[Path], progress: bool = True) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in tqdm(files, desc="load weights", unit="file", disable=not progress or len(files) < 2):
        if not path.is_file():
            raise MoECompileError(f"missing weight file {path}")
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    tensors[key] = f.get_tensor(key)
        except (SafetensorError, OSError, ValueError) as e:
            raise MoECompileError(f"corrupt or truncated safetensors file {path}: {e}") from None
    return tensors


def build_skeleton(config: dict, directory: Path) -> nn.Module:
    """The dense HF model the checkpoint was converted from, built from its config (random weights)."""
    import transformers

    architectures = config.get("architectures") or []
    cls = getattr(transformers, architectures[0], None) if architectures else None
    if cls is None:
        raise MoECompileError(f"{directory}: config.json names no transformers architecture to rebuild the model")
    try:
        hf_config = transformers.AutoConfig.from_pretrained(directory)  # reads config.json only
        if hasattr(hf_config, "moe"):
            delattr(hf_config, "moe")
        return cls(hf_config)
    except Exception as e:  # noqa: BLE001
        raise MoECompileError(f"{directory}: cannot build {architectures[0]} from config.json: {e}") from None


def load_state(model: nn.Module, tensors: dict[str, torch.Tensor], where: Path) -> None:
    """Copy tensors into model, requiring an exact fit (tied parameters may be stored once)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = {**params, **{n: b for n, b in model.named_buffers() if n in model.state_dict()}}
    for key, t in tensors.items():
        if key not in expected:
            raise MoECompileError(f"checkpoint does not match its config: unexpected tensor {key} in {where}")
        if tuple(expected[key].shape) != tuple(t.shape):
            raise MoECompileError(f"checkpoint does not match its config: {key} has shape {tuple(t.shape)}, "
                                  f"config implies {tuple(expected[key].shape)}")
    loaded_ids = {id(expected[k]) for k in tensors}
    missing = [k for k, v in expected.items() if k not in tensors and id(v) not in loaded_ids]
    if missing:
        raise MoECompileError(f"checkpoint does not match its config: {len(missing)} tensors missing, "
                              f"e.g. {missing[0]}")
    floats = [t.dtype for t in tensors.values() if t.is_floating_point()]
    if floats:
        model.to(floats[0])
    model.load_state_dict(tensors, strict=False)


def load(directory: str | os.PathLike, model: nn.Module | None = None, progress: bool = True) -> nn.Module:
    """Load a checkpoint written by save(). Pass `model` (a dense skeleton) for non-HF models."""
    directory = Path(directory)
    if not directory.is_dir():
        raise MoECompileError(f"no such checkpoint directory: {directory}")
    config = _read_config(directory)
    moe = config.get("moe")
    if not isinstance(moe, dict) or not isinstance(moe.get("blocks"), list):
        raise MoECompileError(f"{directory} is not a moecompile checkpoint: config.json has no moe section")
    if moe.get("format_version") != layout.FORMAT_VERSION:
        raise MoECompileError(f"{directory}: unsupported moe format_version {moe.get('format_version')!r}")
    tensors = read_tensors(weight_files(directory), progress)
    if model is None:
        model = build_skeleton(config, directory)
    layout.apply_layout(model, moe["blocks"])
    load_state(model, tensors, directory)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model.eval()
