"""Kernel settings reach the layers through constructors, not the environment."""

from __future__ import annotations

import pathlib

from jds.model import Decoder, preset
from pallas_kernels.sparse_indexer import IndexerKernelConfig, default_config


def test_indexer_config_reaches_every_layer() -> None:
    conf = IndexerKernelConfig(topk_algorithm="pallas_radix", key_source="gathered")
    for name in ("v32-tiny", "v4-tiny"):
        model = Decoder(preset(name), seed=0, implementation="xla", indexer_config=conf)
        assert all(layer.attn.indexer_config is conf for layer in model.layers)
    assert default_config() == IndexerKernelConfig()


def test_kernel_library_reads_no_environment() -> None:
    root = pathlib.Path(__file__).resolve().parents[1]
    for path in sorted((root / "pallas_kernels").glob("*.py")):
        assert "os.environ" not in path.read_text(), path.name
