"""Orbax checkpoints round-trip bit-exactly, restore the same logits, carry their config, refuse mismatched
models naming the first differing parameter, and are written atomically."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import time

import ml_dtypes
import numpy as np
import pytest

from jds import checkpoint as ckpt
from jds.batch import Chunk
from jds.checkpoint import (META, checkpoint_config, load_checkpoint, read_checkpoint, restore_model,
                            save_checkpoint)
from jds.config import Numerics
from jds.model import Decoder, preset
from jds.nn import export_weights, load_weights
from jds.runner import BoundaryRunner, ModelRunner


def step_logits(model: Decoder, n_tokens: int = 12) -> np.ndarray:
    bs = model.cfg.block_size
    max_len = bs * -(-(n_tokens + 1) // bs)
    runner = BoundaryRunner(model=model, mode="fused", num_blocks=max_len // bs, max_num_seqs=1,
                            max_num_tokens=n_tokens, max_model_len=max_len)
    ids = np.random.default_rng(0).integers(0, 256, n_tokens)
    return runner.execute(ids, [Chunk(0, 0, n_tokens)], np.arange(max_len // bs, dtype=np.int32)[None])


def assert_same_weights(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes(), k


def no_temp_dirs(parent) -> bool:
    return not [p for p in os.listdir(parent) if ".tmp-" in p]


@pytest.mark.parametrize("numerics", [Numerics.bf16(), pytest.param(Numerics.reference(), marks=pytest.mark.slow)])
def test_round_trip_and_same_logits(tmp_path, numerics: Numerics) -> None:
    cfg = dataclasses.replace(preset("v32-tiny"), numerics=numerics)
    a, b = Decoder(cfg, seed=1), Decoder(cfg, seed=2)
    path = tmp_path / "ck"
    save_checkpoint(a, str(path), extra={"note": "x"})
    load_checkpoint(b, str(path))
    wa = export_weights(a)
    assert_same_weights(wa, export_weights(b))
    assert_same_weights(wa, read_checkpoint(path))
    if numerics.fp8_linear:
        assert any(v.dtype.name == "float8_e4m3fn" for v in wa.values())
    assert checkpoint_config(path) == cfg
    assert ckpt.read_meta(path)["extra"] == {"note": "x"}
    np.testing.assert_array_equal(step_logits(a), step_logits(b))


def test_restore_model_builds_from_stored_config_and_nan_bits_survive(tmp_path) -> None:
    cfg = dataclasses.replace(preset("v4-tiny"), numerics=Numerics.reference(), n_layers=2)
    a = Decoder(cfg, seed=3)
    w = export_weights(a)
    # NaN payloads and signed zero must survive storage bit for bit (bf16 and e4m3)
    emb = w["embed.weight"].copy()
    emb.view(np.uint16)[0, :3] = [0x7FC1, 0xFF80, 0x8000]
    wq = w["layers.0.attn.wq_a"].copy()
    assert wq.dtype == ml_dtypes.float8_e4m3fn
    wq.view(np.uint8)[0, :2] = [0x7F, 0x80]
    load_weights(a, {"embed.weight": emb, "layers.0.attn.wq_a": wq}, strict=False)
    save_checkpoint(a, tmp_path / "ck")
    b = restore_model(tmp_path / "ck")
    assert b.cfg == cfg
    assert_same_weights(export_weights(a), export_weights(b))
    stored = read_checkpoint(tmp_path / "ck")
    assert stored["embed.weight"].view(np.uint16)[0, :3].tolist() == [0x7FC1, 0xFF80, 0x8000]
    assert stored["layers.0.attn.wq_a"].view(np.uint8)[0, :2].tolist() == [0x7F, 0x80]


def _settle() -> None:
    time.sleep(0.5)
    gc.collect()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_mismatch_and_corruption_are_refused(tmp_path) -> None:
    path = tmp_path / "ck"
    save_checkpoint(Decoder(preset("v32-tiny"), seed=0), str(path))
    # another config: the first mismatching parameter (and config field) is named
    with pytest.raises(ValueError, match=r"'layers\.2\.[\w.]+' is missing.*'n_layers'"):
        load_checkpoint(Decoder(dataclasses.replace(preset("v32-tiny"), n_layers=3), seed=0), str(path))
    with pytest.raises(ValueError, match=r"parameter 'layers\.0\.attn\.[\w.]+' .*'numerics\."):
        load_checkpoint(Decoder(dataclasses.replace(preset("v32-tiny"), numerics=Numerics.reference())), str(path))
    with pytest.raises(ValueError, match=r"layers\.0\.ffn\.gate"):
        load_checkpoint(Decoder(dataclasses.replace(preset("v32-tiny"), n_routed_experts=4), seed=0), str(path))
    with pytest.raises(ValueError, match=META):
        read_checkpoint(str(tmp_path / "nowhere"))
    # damaged data: a truncated orbax data file is refused, naming the shard and its tensors
    data = [os.path.join(r, f) for r, _, fs in os.walk(path / "shards") for f in fs if os.sep + "d" + os.sep in
            os.path.join(r, f)]
    assert data
    big = max(data, key=os.path.getsize)
    with open(big, "r+b") as f:
        f.truncate(os.path.getsize(big) // 2)
    with pytest.raises(ValueError, match=r"shard 'shards/00000' \(tensors \['"):
        read_checkpoint(str(path))
    _settle()  # orbax's aborted reads report a closed event loop from a worker thread; let that happen here
    # wrong format tag
    meta = json.loads((path / META).read_text())
    meta["format"] = "other"
    (path / META).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="format"):
        read_checkpoint(str(path))
    assert os.path.exists(path / META)


def test_save_is_atomic_and_overwrite_is_guarded(tmp_path, monkeypatch) -> None:
    model = Decoder(preset("v32-tiny"), seed=0)
    # an existing directory that is not a checkpoint is never replaced
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="not a jds checkpoint"):
        save_checkpoint(model, other)
    assert (other / "keep.txt").read_text() == "x"
    # a failure while writing leaves neither the target nor a temporary directory
    target = tmp_path / "ck"

    def boom(self):
        raise OSError("disk full")

    with monkeypatch.context() as m:
        m.setattr(ckpt.CheckpointWriter, "flush", boom)
        with pytest.raises(OSError, match="disk full"):
            save_checkpoint(model, target)
    assert not target.exists() and no_temp_dirs(tmp_path)
    # an existing checkpoint is replaced by a new one (and refused when overwrite=False)
    save_checkpoint(model, target)
    save_checkpoint(Decoder(preset("v32-tiny"), seed=5), target)
    assert_same_weights(read_checkpoint(target), export_weights(Decoder(preset("v32-tiny"), seed=5)))
    with pytest.raises(ValueError, match="already exists"):
        save_checkpoint(model, target, overwrite=False)
    assert no_temp_dirs(tmp_path)


def test_model_runner_uses_the_checkpoint_config(tmp_path) -> None:
    save_checkpoint(Decoder(preset("v4-tiny"), seed=4), tmp_path / "v4")
    runner = ModelRunner.build(checkpoint=str(tmp_path / "v4"), num_blocks=4, max_num_seqs=2, max_num_tokens=16,
                               max_model_len=256)
    assert runner.model.cfg == preset("v4-tiny")
    assert_same_weights(export_weights(runner.model), read_checkpoint(tmp_path / "v4"))
    with pytest.raises(ValueError, match=r"does not match the model.*'arch'"):
        ModelRunner.build(preset="v32-tiny", checkpoint=str(tmp_path / "v4"), num_blocks=4)


def test_unusable_targets_are_named(tmp_path) -> None:
    """A target under a file is a ValueError naming it (was a FileExistsError traceback); an existing directory
    that is not a checkpoint is refused as such even without overwrite (was "pass --overwrite", which would
    not help); a missing checkpoint's error names its path once."""
    cfg = preset("v32-tiny")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match=r"checkpoint '.*afile/ck': cannot create it \(.*afile"):
        ckpt.CheckpointWriter(tmp_path / "afile" / "ck", cfg)
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="not a jds checkpoint or an empty directory; refusing"):
        ckpt.CheckpointWriter(other, cfg, overwrite=False)
    assert (other / "keep.txt").read_text() == "x" and no_temp_dirs(tmp_path)
    with pytest.raises(ValueError) as e:
        checkpoint_config(tmp_path / "missing")
    assert str(e.value).count("checkpoint '") == 1 and "no jds_checkpoint.json" in str(e.value)
