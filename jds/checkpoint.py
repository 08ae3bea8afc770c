"""Orbax checkpoints of a ``Decoder``'s parameters, with the model config stored beside them.

Layout of a checkpoint directory::

    DIR/jds_checkpoint.json    format tag, the ModelConfig (JSON), every tensor's dtype / shape / shard, ``extra``
    DIR/shards/00000/ ...      orbax PyTree checkpoints (PyTreeCheckpointer), each a flat dict name -> array
                               under the DESIGN.md weight names (``layers.3.attn.wq_a``, ``layers.3.attn.wq_a.scale``)

``save_checkpoint`` writes one shard; the HF converter (``jds.hf_import``) writes a new shard whenever its
buffer reaches a byte budget, so converting never holds more than about one budget (or one tensor) in memory.
bfloat16 and float8_e4m3fn arrays are stored natively by orbax/tensorstore and round-trip bit-exactly (checked
in tests/test_checkpoint.py, NaN payloads included), so no uint8 views are needed; the JSON still records each
tensor's true dtype and a restore checks it.

Saving is atomic: everything is written to a temporary directory beside the target and renamed into place;
on any error the temporary directory is removed and no partial checkpoint is left. An existing target is
replaced only when it is a jds checkpoint or an empty directory (``overwrite``), never another directory.

Restoring checks every parameter name, shape and dtype against the model it loads into and raises a
``ValueError`` naming the first mismatching parameter (and the first differing config field), so a checkpoint
of another config never loads silently. :func:`restore_model` builds the model from the stored config.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from typing import Any, Iterator

import numpy as np
from flax import nnx

from jds.config import ModelConfig, config_diff
from jds.nn import export_weights, load_weights
from jds.safetensors_io import read_json

FORMAT = "jds-orbax-v1"
META = "jds_checkpoint.json"
SHARDS = "shards"
DEFAULT_SHARD_BYTES = 1 << 30
CHUNK_BYTES = 64 << 20  # orbax/tensorstore storage chunk of large tensors


# ----- config <-> JSON ---------------------------------------------------------------------------------
# The ModelConfig's (de)serialisation lives with the config (jds.config.ModelConfig.to_dict / from_dict).
def config_to_dict(cfg: ModelConfig) -> dict[str, Any]:
    """A ModelConfig as plain JSON-able data (``ModelConfig.to_dict``)."""
    return cfg.to_dict()


def config_from_dict(d: dict[str, Any]) -> ModelConfig:
    """Inverse of :func:`config_to_dict` (``ModelConfig.from_dict``); an unknown or invalid field is a
    ValueError naming it."""
    return ModelConfig.from_dict(d)


# ----- writing -----------------------------------------------------------------------------------------
def _checkpointer() -> Any:
    import orbax.checkpoint as ocp

    return ocp.PyTreeCheckpointer()


class CheckpointWriter:
    """Streams tensors into a checkpoint: ``add`` buffers them, a full buffer becomes one orbax shard.

    Use as a context manager; leaving it normally publishes the checkpoint (atomic rename), leaving it by
    an exception removes everything written::

        with CheckpointWriter(path, cfg) as w:
            for name, arr in tensors:
                w.add(name, arr)
    """

    def __init__(self, path: str | os.PathLike, config: Any, *, extra: dict[str, Any] | None = None,
                 shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = True):
        self.path = os.path.abspath(os.fspath(path))
        self.config = config
        self.extra = dict(extra or {})
        self.shard_bytes = int(shard_bytes)
        self.overwrite = overwrite
        _check_replaceable(self.path, overwrite)
        parent = os.path.dirname(self.path)
        self.tmp = os.path.join(parent, f".{os.path.basename(self.path)}.tmp-{uuid.uuid4().hex[:12]}")
        try:
            os.makedirs(parent, exist_ok=True)
            os.makedirs(os.path.join(self.tmp, SHARDS))
        except OSError as e:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise ValueError(f"checkpoint {self.path!r}: cannot create it ({e.strerror or e}: "
                             f"{e.filename or parent!r})") from None
        self.tensors: dict[str, dict[str, Any]] = {}
        self.shards: list[str] = []
        self._buf: dict[str, np.ndarray] = {}
        self._buf_bytes = 0
        self._done = False

    def __enter__(self) -> "CheckpointWriter":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def add(self, name: str, arr: Any) -> None:
        if self._done:
            raise ValueError("CheckpointWriter: already closed")
        if name in self.tensors or name in self._buf:
            raise ValueError(f"checkpoint tensor {name!r}: written twice")
        arr = np.asarray(arr)
        self._buf[name] = arr
        self._buf_bytes += arr.nbytes
        if self._buf_bytes >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        """Write the buffered tensors as one orbax shard."""
        if not self._buf:
            return
        import orbax.checkpoint as ocp

        rel = os.path.join(SHARDS, f"{len(self.shards):05d}")
        # chunked storage bounds the buffers tensorstore allocates per write/read of a large tensor
        args = {n: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES) for n in self._buf}
        _checkpointer().save(os.path.join(self.tmp, rel), dict(self._buf), save_args=args)
        for n, a in self._buf.items():
            self.tensors[n] = {"dtype": a.dtype.name, "shape": list(a.shape), "shard": len(self.shards)}
        self.shards.append(rel)
        self._buf, self._buf_bytes = {}, 0

    def close(self) -> None:
        if self._done:
            return
        try:
            self.flush()
            meta = {"format": FORMAT, "config": config_to_dict(self.config), "shards": self.shards,
                    "tensors": self.tensors, "extra": self.extra}
            with open(os.path.join(self.tmp, META), "w") as f:
                json.dump(meta, f, indent=1)
            _publish(self.tmp, self.path, self.overwrite)
        except BaseException:
            self.abort()
            raise
        self._done = True

    def abort(self) -> None:
        self._done = True
        self._buf = {}
        shutil.rmtree(self.tmp, ignore_errors=True)


def _is_checkpoint_dir(path: str) -> bool:
    return os.path.isdir(path) and (not os.listdir(path) or os.path.exists(os.path.join(path, META)))


def _check_replaceable(path: str, overwrite: bool) -> None:
    if not os.path.lexists(path):
        return
    if not _is_checkpoint_dir(path):  # first: --overwrite would not help here
        raise ValueError(f"checkpoint {path!r}: exists and is not a jds checkpoint or an empty directory; "
                         "refusing to replace it")
    if not overwrite:
        raise ValueError(f"checkpoint {path!r}: already exists (pass overwrite / --overwrite to replace it)")


def _publish(tmp: str, path: str, overwrite: bool) -> None:
    """Rename ``tmp`` to ``path``; an existing (checkpoint) ``path`` is moved aside first, then deleted."""
    _check_replaceable(path, overwrite)
    old = None
    if os.path.lexists(path):
        old = f"{tmp}.old"
        os.rename(path, old)
    try:
        os.rename(tmp, path)
    except BaseException:
        if old:
            os.rename(old, path)
        raise
    if old:
        shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(model: nnx.Module, path: str | os.PathLike, *, extra: dict[str, Any] | None = None,
                    overwrite: bool = True) -> None:
    """Write ``model``'s parameters (and ``model.cfg``) as an orbax checkpoint directory at ``path``."""
    cfg = getattr(model, "cfg", None)
    if cfg is None:
        raise ValueError("save_checkpoint: the model has no .cfg (a jds Decoder is expected)")
    weights = export_weights(model)
    with CheckpointWriter(path, cfg, extra=extra, shard_bytes=1 << 62, overwrite=overwrite) as w:
        for name in sorted(weights):
            w.add(name, weights[name])


# ----- reading -----------------------------------------------------------------------------------------
def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint's ``jds_checkpoint.json`` (validated format)."""
    path = os.fspath(path)
    mpath = os.path.join(path, META)
    if not os.path.exists(mpath):
        if os.path.exists(os.path.join(path, "manifest.json")):
            raise ValueError(f"checkpoint {path!r}: no {META}; this is the retired jds-weights-v1 format "
                             "(manifest.json + weights.bin): re-create it (scripts/make_checkpoint.py)")
        raise ValueError(f"checkpoint {path!r}: no {META} (is it a jds checkpoint directory?)")
    meta = read_json(mpath, f"checkpoint {path!r}")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        fmt = meta.get("format") if isinstance(meta, dict) else None
        raise ValueError(f"checkpoint {path!r}: format {fmt!r}, expected {FORMAT!r}")
    for k in ("config", "shards", "tensors"):
        if k not in meta:
            raise ValueError(f"checkpoint {path!r}: {META} lacks field {k!r}")
    return meta


def checkpoint_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig stored in a checkpoint."""
    meta = read_meta(path)  # its errors name the checkpoint already
    try:
        return config_from_dict(meta["config"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint {os.fspath(path)!r}: {e}") from e


def iter_shards(path: str | os.PathLike, meta: dict[str, Any] | None = None,
                shardings: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """Yield each shard's tensors (numpy, true dtypes) in turn, checked against the JSON.

    ``shardings`` (tensor name -> ``jax.sharding.Sharding``): those tensors come back as ``jax.Array``s laid
    out that way, each device's slice read by tensorstore from the stored chunks that hold it (orbax's
    sharded restore), never the whole tensor through the host."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    meta = meta or read_meta(path)
    by_shard: dict[int, list[str]] = {}
    for name, t in meta["tensors"].items():
        by_shard.setdefault(int(t["shard"]), []).append(name)
    for i, rel in enumerate(meta["shards"]):
        names = by_shard.get(i, [])
        where = f"checkpoint {path!r}, shard {rel!r} (tensors {names[:3]}{'...' if len(names) > 3 else ''})"
        sdir = os.path.join(path, rel)
        if not os.path.isdir(sdir):
            raise ValueError(f"{where}: directory missing")
        try:
            args = {n: _restore_args(ocp, meta["tensors"][n], (shardings or {}).get(n)) for n in names}
            got = _checkpointer().restore(sdir, restore_args=args)
        except Exception as e:  # orbax / tensorstore raise many types for damaged files
            raise ValueError(f"{where}: cannot be read (damaged or truncated?): {type(e).__name__}: {e}") from e
        if not isinstance(got, dict):
            raise ValueError(f"{where}: unexpected tree {type(got).__name__}")
        out = {}
        for n in names:
            t = meta["tensors"][n]
            if n not in got:
                raise ValueError(f"checkpoint {path!r}: tensor {n!r} missing from shard {rel!r}")
            a = got[n] if n in (shardings or {}) else np.asarray(got[n])
            if a.dtype.name != t["dtype"] or list(a.shape) != list(t["shape"]):
                raise ValueError(f"checkpoint {path!r}: tensor {n!r} restored as {a.dtype}{list(a.shape)}, "
                                 f"{META} says {t['dtype']}{t['shape']}")
            out[n] = a
        yield out


def _restore_args(ocp: Any, t: dict[str, Any], sharding: Any) -> Any:
    """How orbax restores one tensor: to host numpy, or straight into ``sharding``."""
    if sharding is None:
        return ocp.RestoreArgs(restore_type=np.ndarray)
    import jax
    import jax.numpy as jnp

    return ocp.ArrayRestoreArgs(restore_type=jax.Array, sharding=sharding, global_shape=tuple(t["shape"]),
                                dtype=jnp.dtype(t["dtype"]))


def read_checkpoint(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint as numpy arrays under their DESIGN.md names."""
    out: dict[str, np.ndarray] = {}
    for shard in iter_shards(path):
        out.update(shard)
    return out


def check_compatible(model: nnx.Module, path: str | os.PathLike, meta: dict[str, Any] | None = None) -> None:
    """ValueError naming the first parameter whose name, shape or dtype differs between model and checkpoint."""
    from jds.nn import _param_paths

    path = os.fspath(path)
    meta = meta or read_meta(path)
    tensors = meta["tensors"]
    want: dict[str, tuple[list[int], str]] = {}
    for name, (owner, attr, rows) in _param_paths(model).items():
        v = getattr(owner, attr).get_value()
        shape = list(v.shape) if rows is None else [rows[1] - rows[0]] + list(v.shape[1:])
        want[name] = (shape, np.dtype(v.dtype).name)
    problem = None
    for name, (shape, dt) in want.items():
        t = tensors.get(name)
        if t is None:
            problem = f"parameter {name!r} is missing from the checkpoint"
        elif list(t["shape"]) != shape:
            problem = f"parameter {name!r} has shape {tuple(t['shape'])} in the checkpoint, {tuple(shape)} in the model"
        elif t["dtype"] != dt:
            problem = f"parameter {name!r} has dtype {t['dtype']} in the checkpoint, {dt} in the model"
        if problem:
            break
    if problem is None:
        extra = [n for n in tensors if n not in want]
        if extra:
            problem = f"checkpoint tensor {extra[0]!r} is not a parameter of the model"
    if problem is None:
        return
    hint = ""
    mcfg = getattr(model, "cfg", None)
    if mcfg is not None:
        try:
            d = config_diff(config_from_dict(meta["config"]), mcfg)
        except (TypeError, ValueError):
            d = None
        if d:
            hint = f" (configs differ first in field {d[0]!r}: checkpoint {d[1]!r}, model {d[2]!r})"
    raise ValueError(f"checkpoint {path!r} does not match the model: {problem}{hint}")


def load_checkpoint(model: nnx.Module, path: str | os.PathLike) -> None:
    """Load a checkpoint into ``model`` in place (strict: same names, shapes and dtypes), one shard at a time."""
    meta = read_meta(path)
    check_compatible(model, path, meta)
    for shard in iter_shards(path, meta):
        load_weights(model, shard, strict=False)


def restore_model(path: str | os.PathLike, *, implementation: str = "auto", seed: int = 0, config: Any = None) -> Any:
    """A ``Decoder`` built from the checkpoint's stored config (or ``config``) with its parameters loaded."""
    from jds.model import Decoder

    cfg = config if config is not None else checkpoint_config(path)
    model = Decoder(cfg, seed=seed, implementation=implementation)
    load_checkpoint(model, path)
    return model


def restore_sharded(path: str | os.PathLike, mesh: Any, *, implementation: str = "auto", seed: int = 0,
                    config: Any = None, progress: Any = None) -> Any:
    """A ``Decoder`` whose parameters go from the checkpoint straight into their shards on ``mesh``.

    Why: a full DeepSeek model does not fit one device, nor one host as a random-initialised copy. The model is
    built abstractly (``nnx.eval_shape``: shapes only, no random init), then the checkpoint is read one orbax
    shard at a time and every tensor is placed with the partition rules of ``jds.sharding``: a parameter
    stored whole is restored by orbax straight into that sharding (each device's slice read from the stored
    chunks that hold it: ``iter_shards(shardings=)``); the parts of a fused parameter (several checkpoint
    tensors, one GEMM) are assembled in one host buffer and then placed (``jax.make_array_from_callback``). ``progress(done, total)`` is
    called after each tensor. The result equals ``restore_model`` followed by the runner's placement.
    """
    import jax
    from jax.sharding import NamedSharding

    from jds import sharding
    from jds.model import Decoder
    from jds.nn import _param_paths

    path = os.fspath(path)
    meta = read_meta(path)
    cfg = config if config is not None else checkpoint_config(path)
    model = nnx.eval_shape(lambda: Decoder(cfg, seed=seed, implementation=implementation))
    check_compatible(model, path, meta)
    var_path = {id(v): "/".join(str(k) for k in p) + "/value"
                for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)}
    names = _param_paths(model)
    parts: dict[int, int] = {}  # fused parameter -> how many checkpoint tensors fill it
    for owner, attr, rows in names.values():
        if rows is not None:
            key = id(getattr(owner, attr))
            parts[key] = parts.get(key, 0) + 1
    fused: dict[int, list[Any]] = {}  # variable id -> [host buffer, parts still missing]
    done, total = 0, len(names)

    def target(var: Any) -> NamedSharding:
        return NamedSharding(mesh, sharding.param_spec(var_path[id(var)], tuple(var.shape), cfg, mesh))

    def place(var: Any, host: np.ndarray) -> None:
        var.set_value(jax.make_array_from_callback(host.shape, target(var), lambda idx: host[idx]))

    # a whole parameter is restored straight into its shards; a fused one's parts go through one host buffer
    direct = {name: target(getattr(owner, attr)) for name, (owner, attr, rows) in names.items() if rows is None}
    for shard in iter_shards(path, meta, shardings=direct):
        for name, arr in shard.items():
            owner, attr, rows = names[name]
            var = getattr(owner, attr)
            if rows is None:
                var.set_value(arr)
            else:
                buf = fused.setdefault(id(var), [np.zeros(var.shape, var.dtype), parts[id(var)]])
                buf[0][rows[0]:rows[1]] = arr
                buf[1] -= 1
                if buf[1] == 0:
                    place(var, fused.pop(id(var))[0])
            done += 1
            if progress:
                progress(done, total)
    left = [p for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)
            and isinstance(v.get_value(), jax.ShapeDtypeStruct)]
    if left:
        raise ValueError(f"checkpoint {path!r}: no values for {['/'.join(map(str, p)) for p in left[:3]]}")
    return model
