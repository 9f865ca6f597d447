"""Checkpoints: an HF-style folder (config.json with an `moe` section, safetensors weights, tokenizer files).

config.json is the dense source model's Hugging Face config with model_type MODEL_TYPE and architectures
["MoECompileCheckpoint"]: transformers knows neither, so AutoModel* refuses the folder instead of building the dense
model with freshly initialised FFNs, and its message quotes the model_type, which says to use moecompile.load. A
note in config.json and the model card README.md say the same. The source's own model_type and architectures are
kept in `moe.source`; folders written before that (format_version 1, the source's model_type at the top) are read
as they are.

save() writes into a temporary sibling folder and renames it into place at the end, so a failed or interrupted
run leaves no directory behind. load() builds the model from config.json alone (no pickle, no remote code),
puts MoEBlocks where the `moe` section says, and fills every tensor from the safetensors files, refusing files
that are corrupt or do not fit the config.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_model
from torch import nn
from tqdm.auto import tqdm

from moecompile.core.errors import MoECompileError
from moecompile.ir import fp8, knobs, layout
from moecompile.ir.block import MoEBlock
from moecompile.ir.config import MoEConfig

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja")
GENERATION_CONFIG = "generation_config.json"
DEFAULT_SHARD_SIZE = knobs.SHARD_SIZE
# config.json model_type of moecompile's format: transformers' refusal quotes it (see the module docstring)
MODEL_TYPE = "moecompile-checkpoint: load it with moecompile.load"
MODEL_TYPES = (MODEL_TYPE, "moecompile")  # and the one written before
NOTE_KEY = "moecompile_note"
NOTE = ("A moecompile checkpoint: load it with `import moecompile; moecompile.load(folder)`. Plain transformers "
        "refuses it on purpose: its MoE blocks are not a transformers architecture, and the dense model built from "
        "this config would get random FFN weights. See README.md.")
MODEL_CARD = "README.md"
ARCHITECTURE = "MoECompileCheckpoint"
SOURCE_KEYS = ("model_type", "architectures")  # the source's identity, moved into moe.source
FORMAT_VERSIONS = (1, layout.FORMAT_VERSION)  # 1: the source's model_type and architectures at the top
NATIVE_RECORD = "moecompile"  # config.json entry of a native HF MoE checkpoint: how convert made it
PARTIAL = ".partial"  # suffix of the temporary folder a save writes into
PARTIAL_MARKER = ".moecompile-partial"  # inside a partial folder: the writing process's pid, so only ours are removed
_writing: set[Path] = set()  # this process's partial folders, removed by abandon_partials on a signal
_publishing = threading.Lock()  # a partial folder is renamed into place or removed, never both at once


def check_output_dir(directory: str | os.PathLike) -> Path:
    """Refuse an existing non-empty output directory before any work is done."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise MoECompileError(f"output folder {directory} is an existing file: give a folder that does not exist "
                              "or is empty")
    if directory.exists() and any(directory.iterdir()):
        raise MoECompileError(f"output folder {directory} exists and is not empty")
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
    if any(getattr(block, "experts_sharded", False) for _, block in layout.moe_blocks(model)):
        raise MoECompileError("this model's experts are sharded over ranks: save it with moecompile.distributed.save")
    blocks = layout.get_layout(model)
    with atomic_directory(directory) as tmp, tqdm(total=3, desc="save", unit="step", disable=not progress) as bar:
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
        if any("fp8" in b for b in blocks):
            from moecompile.ir.fp8 import quantization_config

            config["quantization_config"] = quantization_config(model)
        write_moe_config(tmp, config, {"blocks": blocks})
        bar.update()
        copy_tokenizer(tokenizer_dir, tmp)
        for name, data in (extra_files or {}).items():
            (tmp / name).write_bytes(data)
        bar.update()
    return Path(directory)


@contextlib.contextmanager
def atomic_directory(directory: str | os.PathLike) -> Iterator[Path]:
    """A temporary sibling folder to write into: renamed to `directory` when the block succeeds, removed when it
    fails or is interrupted, so no half-written output is ever left. Refuses an existing non-empty directory. First
    removes the partial folders that dead runs of moecompile left in the same parent folder."""
    directory = check_output_dir(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(directory.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.{os.getpid()}.", suffix=PARTIAL, dir=directory.parent))
    _writing.add(tmp)
    try:
        (tmp / PARTIAL_MARKER).write_text(json.dumps({"pid": os.getpid()}) + "\n")
        yield tmp
        publish(tmp, directory)
    except BaseException:
        with _publishing:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        _writing.discard(tmp)


def abandon_partials() -> None:
    """Remove every partial folder this process is writing, and let none be published after: the last act of a
    process about to exit on a signal. Leaves the publishing lock held."""
    _publishing.acquire()
    for tmp in list(_writing):
        for _ in range(3):  # a writer thread may still be creating a file in it
            shutil.rmtree(tmp, ignore_errors=True)
            if not tmp.exists():
                break


def _partial_pid(folder: Path) -> int | None:
    """The pid of the moecompile run writing `folder` (.<name>.<pid>.<random>.partial holding a marker that names
    the same pid), or None when the folder is not one of ours."""
    head = folder.name[:-len(PARTIAL)].rsplit(".", 1)[0] if folder.name.endswith(PARTIAL) else ""
    pid = head.rsplit(".", 1)[-1]
    if not folder.name.startswith(".") or not pid.isdigit():
        return None
    try:
        marked = json.loads((folder / PARTIAL_MARKER).read_text()).get("pid")
    except (OSError, ValueError, AttributeError):
        return None
    return int(pid) if marked == int(pid) else None


def remove_stale_partials(parent: Path) -> None:
    """Remove what killed runs of moecompile left in parent (SIGKILL, power loss): partial folders marked as ours
    whose writing process is gone."""
    for stale in parent.glob(f".*{PARTIAL}"):
        pid = _partial_pid(stale) if stale.is_dir() else None
        if pid is not None and not _alive(pid):
            shutil.rmtree(stale, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def publish(tmp: Path, directory: Path) -> None:
    """Rename a finished temporary folder to `directory` (absent or empty), with default permissions."""
    with _publishing:
        (tmp / PARTIAL_MARKER).unlink(missing_ok=True)
        _default_permissions(tmp)
        if directory.exists():
            directory.rmdir()  # empty, checked before writing
        os.rename(tmp, directory)


def write_config(directory: Path, config: dict) -> None:
    (directory / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_moe_config(directory: Path, config: dict, moe: dict) -> None:
    """config.json of a moecompile checkpoint from the source model's config (as save_pretrained writes it, or as
    read_moe_config returns it) and the moe section's fields: the source's identity moves into moe.source. A folder
    that moecompile.load reads (not an expert-parallel shard set) also gets its model card."""
    config = {k: v for k, v in config.items() if k not in ("moe", NOTE_KEY)}
    source = {k: config.pop(k) for k in SOURCE_KEYS if k in config}
    config.update({NOTE_KEY: NOTE, "model_type": MODEL_TYPE, "architectures": [ARCHITECTURE],
                   "moe": {**moe, "format_version": layout.FORMAT_VERSION, "source": source}})
    write_config(directory, config)
    if "expert_parallel" not in moe:
        (directory / MODEL_CARD).write_text(model_card(source, moe["blocks"]))


def model_card(source: dict, blocks: list[dict]) -> str:
    """README.md of a moecompile checkpoint: what it is, how to load it, why plain transformers refuses it."""
    arch = (source.get("architectures") or [source.get("model_type") or "model"])[0]
    configs = [b["config"] for b in blocks]
    kinds = sorted({f"{c.get('method', 'custom')}, {c['num_experts']} experts, top-{c.get('top_k')}, "
                    + ("dropless" if not c.get("capacity_factor") else f"capacity factor {c['capacity_factor']}")
                    + (", FP8 experts" if "fp8" in b else "") for b, c in zip(blocks, configs)})
    return "\n".join([
        f"# {arch} with MoE blocks (moecompile format)", "",
        f"Made with moecompile: {len(blocks)} FFNs of a {arch} became MoE blocks ({'; '.join(kinds)}).", "",
        "## Load it", "", "```python", "import moecompile", "",
        "model = moecompile.load(\"path/to/this/folder\")  # the model with its MoE blocks, in eval mode",
        "fast = moecompile.compile(model)                  # the torch.compile backend", "```", "",
        "## Why plain transformers refuses it", "",
        f"config.json has model_type `{MODEL_TYPE}`, which transformers does not know, so `AutoModel*.from_pretrained` "
        "raises instead of loading. That is on purpose: the MoE blocks (`moecompile.MoEBlock`) are not a "
        f"transformers architecture, and a {arch} built from this config would have randomly initialised FFNs. "
        "`moecompile.load` rebuilds the model and puts the blocks back. The source's own model_type and architectures "
        "are in config.json under `moe.source`.", ""])


def copy_tokenizer(source: str | os.PathLike | None, directory: Path) -> None:
    if source is not None:
        for name in TOKENIZER_FILES:
            if (Path(source) / name).is_file():
                shutil.copy2(Path(source) / name, directory / name)


def copy_generation_config(source: Path, directory: Path) -> None:
    """The source's generation defaults, beside the config as save_pretrained writes them (when it has any)."""
    if (source / GENERATION_CONFIG).is_file():
        shutil.copy2(source / GENERATION_CONFIG, directory / GENERATION_CONFIG)


def _default_permissions(folder: Path) -> None:
    """mkdtemp makes a private folder; give the result the permissions a plain mkdir/open would."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for f in folder.iterdir():
        os.chmod(f, 0o666 & ~umask)


def read_config(directory: Path) -> dict:
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


def tensor_headers(files: list[Path]) -> dict[str, tuple[Path, tuple, str]]:
    """name -> (file, shape, safetensors dtype) of every tensor in the files, from their headers alone (no data)."""
    headers = {}
    for path in files:
        if not path.is_file():
            raise MoECompileError(f"missing weight file {path}")
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    view = f.get_slice(key)
                    headers[key] = (path, tuple(view.get_shape()), view.get_dtype())
        except (SafetensorError, OSError, ValueError) as e:
            raise MoECompileError(f"corrupt or truncated safetensors file {path}: {e}") from None
    return headers


def build_skeleton(config: dict, directory: Path) -> nn.Module:
    """The dense HF model the checkpoint was converted from, built from its config as read_moe_config returns it
    (random weights)."""
    import transformers

    architectures = config.get("architectures") or []
    cls = getattr(transformers, architectures[0], None) if architectures else None
    if cls is None:
        raise MoECompileError(f"{directory}: config.json names no transformers architecture to rebuild the model")
    # moe and quantization_config are ours: the layout rebuilds the blocks, FP8 ones included
    dense = {k: v for k, v in config.items() if k not in ("moe", "quantization_config")}
    try:
        hf_config = transformers.CONFIG_MAPPING[dense["model_type"]].from_dict(dense)  # as AutoConfig reads it
        return cls(hf_config)
    except Exception as e:  # noqa: BLE001
        raise MoECompileError(f"{directory}: cannot build {architectures[0]} from config.json: {e}") from None


def check_fit(model: nn.Module, stored: dict[str, tuple[tuple, torch.dtype]], where: Path) -> None:
    """Require the stored tensors (name -> (shape, dtype)) to fit model exactly (tied parameters may be stored once);
    works on a model on the meta device, so a checkpoint can be checked from its headers alone."""
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = {**params, **{n: b for n, b in model.named_buffers() if n in model.state_dict()}}
    for key, (shape, dtype) in stored.items():
        if key not in expected:
            raise MoECompileError(f"checkpoint does not match its config: unexpected tensor {key} in {where}")
        if tuple(expected[key].shape) != tuple(shape):
            raise MoECompileError(f"checkpoint does not match its config: {key} has shape {tuple(shape)}, "
                                  f"config implies {tuple(expected[key].shape)}")
        if torch.float8_e4m3fn in (dtype, expected[key].dtype) and dtype != expected[key].dtype:
            raise MoECompileError(f"checkpoint does not match its config: {key} is {dtype}, config implies "
                                  f"{expected[key].dtype}")  # a cast to or from FP8 would ignore the scales
    loaded_ids = {id(expected[k]) for k in stored}
    missing = [k for k, v in expected.items() if k not in stored and id(v) not in loaded_ids]
    if missing:
        raise MoECompileError(f"checkpoint does not match its config: {len(missing)} tensors missing, "
                              f"e.g. {missing[0]}")


def load_state(model: nn.Module, tensors: dict[str, torch.Tensor], where: Path) -> None:
    """Copy tensors into model, requiring an exact fit (check_fit)."""
    check_fit(model, {k: (tuple(t.shape), t.dtype) for k, t in tensors.items()}, where)
    # the model's dtype: that of its float tensors other than FP8 weights and their float32 scales
    floats = [t.dtype for k, t in tensors.items()
              if t.is_floating_point() and t.element_size() > 1 and not k.endswith("_scale_inv")]
    if floats:
        model.to(floats[0])
    model.load_state_dict(tensors, strict=False)


def read_moe_config(directory: Path) -> tuple[dict, dict]:
    """config.json of a moecompile checkpoint, with the source model's model_type and architectures back in place
    (the dense model's config), and its validated `moe` section."""
    if not directory.is_dir():
        raise MoECompileError(f"no such checkpoint directory: {directory}")
    config = read_config(directory)
    moe = config.get("moe")
    if not isinstance(moe, dict) or not isinstance(moe.get("blocks"), list):
        raise MoECompileError(f"{directory} is not a moecompile checkpoint: config.json has no moe section")
    if moe.get("format_version") not in FORMAT_VERSIONS:
        raise MoECompileError(f"{directory}: unsupported moe format_version {moe.get('format_version')!r}")
    if config.get("model_type") in MODEL_TYPES:
        source = moe.get("source")
        if not isinstance(source, dict):
            raise MoECompileError(f"{directory}: config.json has model_type {config['model_type']!r} but no moe.source")
        config = {**{k: v for k, v in config.items() if k not in (*SOURCE_KEYS, NOTE_KEY)}, **source}
    return config, moe


def _load_native(directory: Path) -> nn.Module:
    """A native Hugging Face MoE checkpoint (convert --format hf): transformers' own class, in eval mode."""
    import transformers

    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, use_safetensors=True,
                                                                  local_files_only=True)
    except Exception as e:  # noqa: BLE001
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MoECompileError(f"cannot load {directory}: {first}") from None
    return model.eval()


def refuse_sharded(directory: Path, moe: dict) -> None:
    """A checkpoint whose experts are sharded over ranks is read by moecompile.distributed.load only."""
    if "expert_parallel" in moe:
        world = moe["expert_parallel"].get("world_size")
        raise MoECompileError(f"{directory} holds experts sharded over {world} ranks: load it with "
                              f"moecompile.distributed.load on {world} ranks, or merge it first with "
                              f"`moecompile checkpoint gather {directory} OUT`")


def apply_layout(model: nn.Module, entries: list[dict]) -> nn.Module:
    """Put fresh MoEBlocks (and Identities) where the layout `entries` say: the skeleton that load() fills.
    An entry with an "fp8" field gets FP8 experts (moecompile.ir.fp8)."""
    for entry in entries:
        try:
            model.get_submodule(entry["path"])
            for p in entry.get("identity", []):
                model.get_submodule(p)
        except AttributeError as e:
            raise MoECompileError(f"MoE layout does not fit this model: {e}") from None
        block = MoEBlock(MoEConfig.from_dict(entry["config"]))
        if "fp8" in entry:
            fp8.check_format(entry["fp8"], f"MoE block {entry['path']}")
            block.experts = fp8.MoEExpertsFP8.empty(block.config)
        model.set_submodule(entry["path"], block)
        for p in entry.get("identity", []):
            model.set_submodule(p, nn.Identity())
    object.__setattr__(model, layout.LAYOUT_ATTR, [dict(e) for e in entries])
    return model


def load(directory: str | os.PathLike, model: nn.Module | None = None, progress: bool = True) -> nn.Module:
    """Load a checkpoint written by save(). Pass `model` (a dense skeleton) for non-HF models."""
    directory = Path(directory)
    if directory.is_dir() and (directory / CONFIG).is_file():
        saved = read_config(directory)
        if NATIVE_RECORD in saved and "moe" not in saved:
            return _load_native(directory)
    config, moe = read_moe_config(directory)
    refuse_sharded(directory, moe)
    tensors = read_tensors(weight_files(directory), progress)
    if model is None:
        model = build_skeleton(config, directory)
    apply_layout(model, moe["blocks"])
    load_state(model, tensors, directory)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model.eval()
