"""A small reader/writer of the safetensors format, so that importing HF checkpoints needs no extra package.

The format (https://huggingface.co/docs/safetensors): an 8-byte little-endian unsigned header length N,
then N bytes of JSON ``{name: {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...}``
(plus an optional ``"__metadata__"`` dict of strings; the JSON may be padded with trailing spaces),
then the raw little-endian tensor bytes; offsets count from the first byte after the header.

Reading is lazy and per tensor: :meth:`SafetensorsFile.get` returns a read-only ``np.memmap`` view, so a
caller that converts tensor by tensor keeps only about one tensor in memory. Every malformed input is a
``ValueError`` naming the file and, where there is one, the tensor (a truncated file names the first
tensor whose bytes are missing, when that tensor is asked for).

Sharded checkpoints (``model.safetensors.index.json`` with a ``weight_map`` name -> file) are read through
:class:`SafetensorsDir`, which opens shard files only when one of their tensors is asked for.
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Any, Iterable, Mapping

import ml_dtypes
import numpy as np

# safetensors dtype string -> numpy dtype. F8_E8M0 is the ue8m0 (power-of-two) scale format of V4 checkpoints.
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32), "U16": np.dtype(np.uint16), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES: dict[np.dtype, str] = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024  # the reference implementation's limit as well
INDEX_NAME = "model.safetensors.index.json"


def dtype_name(dt: Any) -> str:
    """The safetensors name of a numpy dtype (ValueError if the format has none)."""
    dt = np.dtype(dt)
    if dt not in _NAMES:
        raise ValueError(f"dtype {dt} has no safetensors name")
    return _NAMES[dt]


class SafetensorsFile:
    """One ``.safetensors`` file: header parsed at open, tensors memory-mapped on demand."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        try:
            size = os.path.getsize(self.path)
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise ValueError(f"safetensors file {self.path!r}: shorter than the 8-byte header length "
                                     "(truncated file?)")
                (n,) = struct.unpack("<Q", head)
                if n > MAX_HEADER:
                    raise ValueError(f"safetensors file {self.path!r}: header length {n} is implausible "
                                     "(not a safetensors file?)")
                if 8 + n > size:
                    raise ValueError(f"safetensors file {self.path!r}: header of {n} bytes runs past the end "
                                     f"of the {size}-byte file (truncated file?)")
                raw = f.read(n)
        except OSError as e:
            raise ValueError(f"safetensors file {self.path!r}: cannot read ({e})") from e
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"safetensors file {self.path!r}: header is not valid JSON ({e})") from e
        if not isinstance(header, dict):
            raise ValueError(f"safetensors file {self.path!r}: header is not a JSON object")
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        if not isinstance(self.metadata, dict):
            raise ValueError(f"safetensors file {self.path!r}: __metadata__ is not a JSON object")
        self.data_start = 8 + n
        self.data_size = size - self.data_start
        self._tensors: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for name, t in header.items():
            self._tensors[name] = self._parse_entry(name, t)

    def _parse_entry(self, name: str, t: Any) -> tuple[np.dtype, tuple[int, ...], int, int]:
        where = f"safetensors file {self.path!r}, tensor {name!r}"
        if not isinstance(t, dict) or not {"dtype", "shape", "data_offsets"} <= set(t):
            raise ValueError(f"{where}: header entry needs dtype, shape and data_offsets")
        if t["dtype"] not in DTYPES:
            raise ValueError(f"{where}: unknown dtype {t['dtype']!r}")
        shape, offs = t["shape"], t["data_offsets"]
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise ValueError(f"{where}: bad shape {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) and o >= 0 for o in offs)
                and offs[0] <= offs[1]):
            raise ValueError(f"{where}: bad data_offsets {offs!r}")
        dt = DTYPES[t["dtype"]]
        want = math.prod(shape) * dt.itemsize
        if offs[1] - offs[0] != want:
            raise ValueError(f"{where}: data_offsets span {offs[1] - offs[0]} bytes but {t['dtype']}{shape} "
                             f"needs {want}")
        return dt, tuple(shape), offs[0], offs[1]

    def keys(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype name, shape) of a tensor; checks its bytes lie inside the file."""
        dt, shape, _, end = self._entry(name)
        if end > self.data_size:
            raise ValueError(f"safetensors file {self.path!r}, tensor {name!r}: its bytes end at {end} but the "
                             f"file holds only {self.data_size} data bytes (truncated file?)")
        return _NAMES[dt], shape

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only memory-mapped array (no copy until used)."""
        self.info(name)
        dt, shape, begin, end = self._entry(name)
        if end == begin:
            return np.zeros(shape, dt)
        return np.memmap(self.path, dtype=dt, mode="r", offset=self.data_start + begin, shape=shape)

    def _entry(self, name: str) -> tuple[np.dtype, tuple[int, ...], int, int]:
        if name not in self._tensors:
            raise ValueError(f"safetensors file {self.path!r}: no tensor {name!r}")
        return self._tensors[name]


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]],
                      metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (name -> array, written in the given order) as one safetensors file."""
    items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    off = 0
    for name, arr in items:
        arr = np.asarray(arr)
        nbytes = arr.size * arr.dtype.itemsize
        header[name] = {"dtype": dtype_name(arr.dtype), "shape": list(arr.shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # pad so the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, arr in items:
            f.write(np.ascontiguousarray(arr).view(np.uint8).reshape(-1).data if np.asarray(arr).size else b"")


def read_json(path: str, label: str) -> Any:
    """The JSON document at ``path``; an unreadable or malformed file is a ValueError "<label>: cannot read
    <file name> (...)" (the checkpoint, HF config and index readers share it)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{label}: cannot read {os.path.basename(path)} ({e})") from e


class SafetensorsDir:
    """All tensors of a HF checkpoint directory: a sharded index, or every ``*.safetensors`` file in it.

    Shards are opened lazily, so a reader of the first layers of a partly downloaded checkpoint works.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            raise ValueError(f"HF checkpoint {self.path!r}: not a directory")
        self._files: dict[str, SafetensorsFile] = {}
        index = os.path.join(self.path, INDEX_NAME)
        self.weight_map: dict[str, str] = {}
        if os.path.exists(index):
            doc = read_json(index, f"HF checkpoint {self.path!r}")
            wm = doc.get("weight_map") if isinstance(doc, dict) else None
            if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
                raise ValueError(f"HF checkpoint {self.path!r}: {INDEX_NAME} has no weight_map of name -> file")
            self.weight_map = dict(wm)
        else:
            shards = sorted(p for p in os.listdir(self.path) if p.endswith(".safetensors"))
            if not shards:
                raise ValueError(f"HF checkpoint {self.path!r}: no {INDEX_NAME} and no *.safetensors files")
            for s in shards:
                for name in self._file(s).keys():
                    if name in self.weight_map:
                        raise ValueError(f"HF checkpoint {self.path!r}: tensor {name!r} is in both "
                                         f"{self.weight_map[name]!r} and {s!r}")
                    self.weight_map[name] = s

    def _file(self, shard: str) -> SafetensorsFile:
        if shard not in self._files:
            p = os.path.join(self.path, shard)
            if not os.path.exists(p):
                raise ValueError(f"HF checkpoint {self.path!r}: shard file {shard!r} does not exist")
            self._files[shard] = SafetensorsFile(p)
        return self._files[shard]

    def names(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _shard_of(self, name: str) -> SafetensorsFile:
        if name not in self.weight_map:
            raise ValueError(f"HF checkpoint {self.path!r}: missing tensor {name!r}")
        shard = self.weight_map[name]
        try:
            f = self._file(shard)
        except ValueError as e:
            raise ValueError(f"tensor {name!r}: {e}") from e
        if name not in f:
            raise ValueError(f"HF checkpoint {self.path!r}: tensor {name!r} is listed in {INDEX_NAME} under "
                             f"{shard!r} but that file does not hold it")
        return f

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        return self._shard_of(name).info(name)

    def get(self, name: str) -> np.ndarray:
        return self._shard_of(name).get(name)
