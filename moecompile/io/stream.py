"""Streaming safetensors writing: a checkpoint written tensor by tensor, never held in memory.

A writer plans every output tensor (name, shape, dtype) before reading any data, so each file's header, the index and
the progress total are known up front; then each tensor is produced by a `read(entry)` callback, written into its file
and dropped. Peak memory is what the callback holds (one source tensor, or a few), whatever the model or shard size.
The native upcycle (conversion/native.py) and the FP8 quantisers (hf_fp8.py, quantize.py) write through here.
"""
from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from moecompile.core.errors import MoECompileError
from moecompile.io.checkpoint import WEIGHTS, WEIGHTS_INDEX, tensor_headers

# safetensors dtype names <-> torch dtypes (the ones a language model checkpoint holds)
ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
             "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
TORCH_TO_ST = {v: k for k, v in ST_DTYPES.items()}


@dataclass
class Entry:
    """One planned output tensor; writers subclass it with where its data comes from."""
    name: str
    shape: tuple
    dtype: str  # safetensors dtype name
    nbytes: int = field(init=False)

    def __post_init__(self):
        numel = 1
        for d in self.shape:
            numel *= d
        self.nbytes = numel * ST_DTYPES[self.dtype].itemsize

    @property
    def numel(self) -> int:
        return self.nbytes // ST_DTYPES[self.dtype].itemsize


@dataclass
class Copy(Entry):
    """A tensor copied as it is from a safetensors file."""
    path: Path | None = None
    source: str = ""  # its name in that file


def copies(files: list[Path]) -> list[Copy]:
    """A Copy of every tensor in the files, from their headers alone."""
    return [Copy(name, shape, st, path=path, source=name) for name, (path, shape, st) in tensor_headers(files).items()]


def read_copy(t: Copy) -> torch.Tensor:
    return read_tensor(t.path, t.source)


def parse_size(size: str | int) -> int:
    """Bytes of a shard size as Hugging Face writes it: 5GB (10**9), 500MB, 2GiB (2**30), 1000 (bytes)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size), re.IGNORECASE)
        if not m:
            raise MoECompileError(f"bad shard size {size!r}: use e.g. 5GB, 500MB, 2GiB or a byte count")
        unit = (m.group(2) or "B").upper()
        scale = 1 if unit == "B" else (1024 if "I" in unit else 1000) ** ("KMGT".index(unit[0]) + 1)
        value = int(float(m.group(1)) * scale)
    if value <= 0:
        raise MoECompileError(f"shard size must be positive, got {size!r}")
    return value


def read_tensor(path: Path, name: str) -> torch.Tensor:
    """One tensor of a safetensors file, the file opened for this read only: no mapping outlives it."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(name)
    except (SafetensorError, OSError, ValueError) as e:
        raise MoECompileError(f"cannot read {name} from {path}: {e}") from None


def shard(plan: list[Entry], max_bytes: int) -> list[tuple[str, list[Entry]]]:
    """(file name, entries) of each output file, in plan order, each file at most max_bytes unless one tensor is
    larger; the names save_pretrained gives (model.safetensors alone, else model-0000i-of-0000n.safetensors)."""
    groups, size = [[]], 0
    for t in plan:
        if groups[-1] and size + t.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    if len(groups) == 1:
        return [(WEIGHTS, groups[0])]
    return [(f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors", g) for i, g in enumerate(groups)]


def write_files(directory: Path, files: list[tuple[str, list[Entry]]], read: Callable[[Entry], torch.Tensor],
                bar=None) -> int:
    """Write each (file name, entries) into directory, and the index unless the weights are one model.safetensors;
    returns the bytes of tensor data written."""
    for name, entries in files:
        write_file(directory / name, entries, read, bar)
    total = sum(t.nbytes for _, entries in files for t in entries)
    if [name for name, _ in files] != [WEIGHTS]:
        index = {"metadata": {"total_size": total},
                 "weight_map": {t.name: name for name, entries in files for t in entries}}
        (directory / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return total


def write_weights(directory: Path, files: list[tuple[str, list[Entry]]], read: Callable[[Entry], torch.Tensor],
                  desc: str, progress: bool = True) -> int:
    """write_files under a progress bar in bytes; returns the bytes of tensor data written."""
    total = sum(t.nbytes for _, entries in files for t in entries)
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=not progress) as bar:
        return write_files(directory, files, read, bar)


def write_file(path: Path, entries: list[Entry], read: Callable[[Entry], torch.Tensor], bar=None) -> None:
    """One safetensors file written tensor by tensor: the header (known from the plan) first, then each tensor's
    bytes as soon as it is read, so a file is never held in memory."""
    # larger elements first (as safetensors orders them), so every tensor starts aligned to its element size
    entries = sorted(entries, key=lambda t: -ST_DTYPES[t.dtype].itemsize)
    header, offset = {}, 0
    for t in entries:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors pads it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in entries:
            value = read(t)
            if value.dtype != ST_DTYPES[t.dtype] or tuple(value.shape) != tuple(t.shape):
                raise MoECompileError(f"{t.name}: got {value.dtype} {tuple(value.shape)}, planned {t.dtype} "
                                      f"{tuple(t.shape)}")
            data = value.contiguous().reshape(-1).view(torch.uint8).numpy() if value.numel() else b""
            f.write(data)
            if bar is not None:
                bar.update(t.nbytes)
