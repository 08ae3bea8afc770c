"""Checkpoints round-trip bit-exactly, restore the same logits, and refuse mismatched models."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

from jds.batch import Chunk
from jds.checkpoint import load_checkpoint, read_checkpoint, save_checkpoint
from jds.config import Numerics
from jds.model import Decoder, preset
from jds.nn import export_weights
from jds.runner import BoundaryRunner


@pytest.mark.parametrize("numerics", [Numerics.bf16(), Numerics.reference()])
def test_round_trip_and_same_logits(tmp_path, numerics: Numerics) -> None:
    cfg = dataclasses.replace(preset("v32-tiny"), numerics=numerics)
    a, b = Decoder(cfg, seed=1), Decoder(cfg, seed=2)
    save_checkpoint(a, str(tmp_path))
    load_checkpoint(b, str(tmp_path))
    wa, wb = export_weights(a), export_weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert wa[k].dtype == wb[k].dtype and wa[k].tobytes() == wb[k].tobytes(), k
    if numerics.fp8_linear:
        assert any(v.dtype.name == "float8_e4m3fn" for v in wa.values())
    ids = np.random.default_rng(0).integers(0, 256, 12)
    bt = np.arange(4, dtype=np.int32)[None]
    logits = [BoundaryRunner(model=m, mode="fused", num_blocks=4, max_num_seqs=1, max_num_tokens=16,
                             max_model_len=64).execute(ids, [Chunk(0, 0, 12)], bt) for m in (a, b)]
    np.testing.assert_array_equal(logits[0], logits[1])


def test_mismatch_and_corruption_are_refused(tmp_path) -> None:
    save_checkpoint(Decoder(preset("v32-tiny"), seed=0), str(tmp_path))
    with pytest.raises(ValueError, match="weights"):
        load_checkpoint(Decoder(dataclasses.replace(preset("v32-tiny"), n_layers=3), seed=0), str(tmp_path))
    with pytest.raises(ValueError, match="manifest"):
        read_checkpoint(str(tmp_path / "nowhere"))
    with open(tmp_path / "weights.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match="truncated"):
        read_checkpoint(str(tmp_path))
    m = json.loads((tmp_path / "manifest.json").read_text())
    m["format"] = "other"
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match="format"):
        read_checkpoint(str(tmp_path))
    assert os.path.exists(tmp_path / "manifest.json")
