"""A Hugging Face checkpoint folder read tensor by tensor, straight from the safetensors files.

The reader parses each file's header itself and reads a tensor's bytes with ``readinto`` into a
buffer the caller owns (an expert's host blob), so nothing is read twice, no file is mapped
whole, and a truncated or corrupt file is caught with an error naming the file and the tensor.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint folder or file is missing, malformed, truncated or inconsistent."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: file, absolute byte range, dtype and shape."""

    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def resolve_model_dir(path: str | Path) -> Path:
    """Accept a checkpoint folder, or a Hugging Face cache folder ``models--org--name``."""
    root = Path(path).expanduser()
    if not root.exists():
        raise CheckpointError(f"model folder {str(root)!r} does not exist")
    if (root / "config.json").is_file():
        return root
    snapshots = root / "snapshots"
    if snapshots.is_dir():
        ref = root / "refs" / "main"
        if ref.is_file() and (snapshots / ref.read_text().strip() / "config.json").is_file():
            return snapshots / ref.read_text().strip()
        found = sorted(p for p in snapshots.iterdir() if (p / "config.json").is_file())
        if found:
            return max(found, key=lambda p: p.stat().st_mtime)
    raise CheckpointError(f"model folder {str(root)!r} has no config.json (nor an HF cache snapshot with one)")


def read_config_dict(model_dir: Path) -> dict[str, Any]:
    """config.json as a dict, with a clear error when it is not valid JSON."""
    path = model_dir / "config.json"
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or "model_type" not in data:
        raise CheckpointError(f"{path} must be a JSON object with a 'model_type' field")
    return data


class Checkpoint:
    """Every tensor of a (possibly sharded) safetensors checkpoint, indexed by name."""

    def __init__(self, model_dir: str | Path):
        self.dir = resolve_model_dir(model_dir)
        self.config = read_config_dict(self.dir)
        self.entries: dict[str, TensorEntry] = {}
        for file in self._files():
            self.entries.update(_read_header(file))

    def _files(self) -> list[Path]:
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index} is not a valid safetensors index: {exc}") from exc
            files = sorted({self.dir / name for name in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(f"shard(s) listed in {index.name} are missing from {self.dir}: {missing}")
            return files
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no .safetensors files in {self.dir}")
        return files

    def entry(self, key: str) -> TensorEntry:
        """The entry for ``key``, or an error naming the key and the folder."""
        try:
            return self.entries[key]
        except KeyError:
            raise CheckpointError(f"tensor {key!r} is missing from the checkpoint in {self.dir}") from None

    def read(self, key: str) -> torch.Tensor:
        """One whole tensor as a new CPU tensor of its disk dtype."""
        entry = self.entry(key)
        out = torch.empty(entry.shape, dtype=entry.dtype)
        read_into(entry, out.view(-1).view(torch.uint8), entry.start, entry.nbytes)
        return out

    def read_slice(self, key: str, index: int) -> tuple[TensorEntry, int, int]:
        """Byte range of ``tensor[index]`` along dim 0, for fused (3D) expert tensors."""
        entry = self.entry(key)
        if not entry.shape or not 0 <= index < entry.shape[0]:
            raise CheckpointError(f"tensor {key!r} of shape {entry.shape} has no row {index}")
        row = entry.nbytes // entry.shape[0]
        return entry, entry.start + index * row, row


def read_into(entry: TensorEntry, out: torch.Tensor, start: int, nbytes: int) -> None:
    """Read ``nbytes`` from ``entry``'s file at absolute byte ``start`` into the uint8 tensor ``out``."""
    view = out.numpy().data.cast("B")
    with open(entry.path, "rb") as handle:
        handle.seek(start)
        got = handle.readinto(view[:nbytes])
    if got != nbytes:
        raise CheckpointError(f"{entry.path} is truncated: wanted {nbytes} bytes at offset {start}, got {got}")


def _read_header(path: Path) -> dict[str, TensorEntry]:
    size = path.stat().st_size
    with open(path, "rb") as handle:
        raw = handle.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path} is not a safetensors file (shorter than its 8-byte header length)")
        (length,) = struct.unpack("<Q", raw)
        if length > min(_MAX_HEADER, size - 8):
            raise CheckpointError(f"{path} is corrupt or truncated: header length {length} exceeds the file")
        try:
            header = json.loads(handle.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path} has a corrupt safetensors header: {exc}") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has a corrupt safetensors header (not a JSON object)")
    return {k: _entry(path, k, v, 8 + length, size) for k, v in header.items() if k != "__metadata__"}


def _entry(path: Path, key: str, info: Any, base: int, size: int) -> TensorEntry:
    try:
        dtype = _DTYPES[info["dtype"]]
        shape = tuple(int(d) for d in info["shape"])
        begin, end = (int(x) for x in info["data_offsets"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: header entry for {key!r} is malformed ({exc!r})") from exc
    numel = 1
    for d in shape:
        numel *= d
    if end - begin != numel * dtype.itemsize or begin < 0:
        raise CheckpointError(f"{path}: tensor {key!r} byte range does not match its shape {shape} and dtype")
    if base + end > size:
        raise CheckpointError(
            f"{path} is truncated: tensor {key!r} ends at byte {base + end} but the file has {size} bytes"
        )
    return TensorEntry(path, dtype, shape, base + begin, base + end)
