"""HF-format import: a synthetic DeepSeek-V3.2 / V4 checkpoint (config.json, two real safetensors shards with
FP8 e4m3 weights and 128x128 block scales, a sharded index) written by jds.hf_import.export_hf, converted by
scripts/convert_checkpoint.py, restored, and giving the in-memory model's logits exactly; --layers, --dequantize,
and every kind of bad input (a ValueError naming the tensor or field, no output directory left behind)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import ml_dtypes
import numpy as np
import pytest

from jds import hf_import
from jds.checkpoint import load_checkpoint, read_checkpoint, read_meta, restore_model
from jds.config import Numerics
from jds.model import Decoder, preset
from jds.nn import _param_paths, export_weights
from jds.runner import ModelRunner
from jds.safetensors_io import INDEX_NAME, SafetensorsDir, SafetensorsFile, write_safetensors
from tests.test_checkpoint import assert_same_weights, no_temp_dirs, step_logits

ROOT = Path(__file__).resolve().parents[1]
N_TOKENS = {"v32": 12, "v4": 40}


def _script() -> Any:
    spec = importlib.util.spec_from_file_location("convert_checkpoint", ROOT / "scripts" / "convert_checkpoint.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


CONVERT = _script()


def tiny_cfg(arch: str, moe: bool, numerics: Numerics | None = None):
    """The tiny preset in the numerics a checkpoint imports with by default (V4: its released MXFP4 indexer)."""
    released = dataclasses.replace(Numerics.reference(), indexer_fp4=arch == "v4")
    cfg = dataclasses.replace(preset(f"{arch}-tiny"), numerics=numerics or released)
    return dataclasses.replace(cfg, n_routed_experts=4, moe_topk=2) if moe else cfg


def assert_refused(tmp_path: Path, source: Path, mutate: Any, pattern: str,
                   run: Any = None) -> None:
    """A copy of ``source`` spoiled by ``mutate`` is refused with a ValueError matching ``pattern`` (by ``run(hf,
    out)``, default the converter's API), and no output or temporary directory is left behind."""
    hf = tmp_path / "hf"
    shutil.copytree(source, hf)
    mutate(hf)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=pattern):
        (run or (lambda h, o: hf_import.convert_hf_checkpoint(h, o, overrides={"block_size": 128}, progress=False)))(
            hf, out)
    assert not out.exists() and no_temp_dirs(tmp_path)


def convert(src: Path, out: Path, block_size: int, *args: str) -> dict[str, Any]:
    return CONVERT.main([str(src), str(out), "--no-progress", "--override", f"block_size={block_size}", *args])


class Source:
    """A tiny fp8 model, its synthetic HF directory and (lazily) its logits."""

    def __init__(self, root: Path, arch: str, moe: bool):
        self.arch = arch
        self.cfg = tiny_cfg(arch, moe)
        self.model = Decoder(self.cfg, seed=7)
        self.hf = root / f"hf_{arch}"
        hf_import.export_hf(self.model, self.hf, n_shards=2)
        self._logits = None

    @property
    def logits(self) -> np.ndarray:
        if self._logits is None:
            self._logits = step_logits(self.model, N_TOKENS[self.arch])
        return self._logits


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Callable[[str], Source]:
    root = tmp_path_factory.mktemp("hf")
    cache: dict[str, Source] = {}

    def get(arch: str) -> Source:
        if arch not in cache:  # V3.2 with a MoE FFN, V4 with the dense FFN: both FFN mappings end to end
            cache[arch] = Source(root, arch, moe=arch == "v32")
        return cache[arch]

    return get


def test_synthetic_checkpoint_is_real_hf_layout(sources) -> None:
    s = sources("v32")
    index = json.loads((s.hf / INDEX_NAME).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == 2 and all((s.hf / f).exists() for f in shards)
    f = SafetensorsFile(s.hf / shards[0])
    assert f.info("model.layers.0.self_attn.q_a_proj.weight") == ("F8_E4M3", (256, 256))
    assert f.info("model.layers.0.self_attn.q_a_proj.weight_scale_inv") == ("F32", (2, 2))
    cfg = json.loads((s.hf / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in index["weight_map"]


@pytest.mark.parametrize("arch", ["v32", pytest.param("v4", marks=pytest.mark.slow)])
def test_convert_restore_same_logits(tmp_path, sources, arch: str) -> None:
    s = sources(arch)
    out = tmp_path / "out"
    rep = convert(s.hf, out, s.cfg.block_size, "--shard-mb", "1")  # several orbax shards
    assert len(read_meta(out)["shards"]) > 1
    assert rep["config"] == s.cfg
    restored = restore_model(out)
    assert restored.cfg == s.cfg
    assert_same_weights(export_weights(s.model), export_weights(restored))
    np.testing.assert_array_equal(s.logits, step_logits(restored, N_TOKENS[arch]))
    if arch == "v32":  # the MoE routing bias real checkpoints carry is skipped, and said so
        assert sum(len(v) for v in rep["skipped"].values()) == s.cfg.n_layers
    # the server path: ModelRunner.build(checkpoint=...) takes the stored config
    runner = ModelRunner.build(checkpoint=str(out), num_blocks=2, max_num_seqs=1, max_num_tokens=16,
                               max_model_len=s.cfg.block_size)
    assert runner.model.cfg == s.cfg


@pytest.mark.parametrize("arch,moe", [pytest.param("v32", False, marks=pytest.mark.slow), ("v32", True),
                                      pytest.param("v4", False, marks=pytest.mark.slow), ("v4", True)])
def test_mapping_covers_every_parameter(tmp_path, arch: str, moe: bool) -> None:
    """target_spec (no allocation) equals a real model's export; export -> convert is bit-exact for each
    architecture x FFN kind, in both the fp8 and the bf16 numerics."""
    for numerics in (Numerics.reference(), Numerics.bf16()):
        cfg = tiny_cfg(arch, moe, numerics)
        model = Decoder(cfg, seed=11)
        w = export_weights(model)
        spec = hf_import.target_spec(cfg)
        assert spec == {k: (v.shape, v.dtype) for k, v in w.items()}
        hf = tmp_path / f"hf_{numerics.fp8_linear}"
        hf_import.export_hf(model, hf)
        out = tmp_path / f"out_{numerics.fp8_linear}"
        rep = hf_import.convert_hf_checkpoint(hf, out, numerics=numerics, overrides={"block_size": cfg.block_size},
                                              progress=False)
        assert rep["config"] == cfg
        assert_same_weights(w, read_checkpoint(out))


def test_layers_truncation(tmp_path, sources) -> None:
    s = sources("v32")
    out = tmp_path / "out"
    rep = convert(s.hf, out, s.cfg.block_size, "--layers", "1")
    cut = dataclasses.replace(s.cfg, n_layers=1)
    assert rep["config"] == cut and restore_model(out).cfg == cut
    full = export_weights(s.model)
    want = {k: v for k, v in full.items() if not k.startswith("layers.1.")}
    assert_same_weights(want, read_checkpoint(out))
    skipped = [n for names in rep["skipped"].values() for n in names]
    assert "model.layers.1.self_attn.q_a_proj.weight" in skipped
    with pytest.raises(ValueError, match="'layers'"):
        convert(s.hf, tmp_path / "out3", s.cfg.block_size, "--layers", "3")
    assert not (tmp_path / "out3").exists()


def test_dequantize_to_bf16(tmp_path, sources) -> None:
    s = sources("v32")
    out = tmp_path / "out"
    rep = convert(s.hf, out, s.cfg.block_size, "--dequantize")
    cfg = rep["config"]
    assert cfg == dataclasses.replace(s.cfg, numerics=dataclasses.replace(s.cfg.numerics, fp8_linear=False))
    got = read_checkpoint(out)
    assert not any(".scale" in k or v.dtype == ml_dtypes.float8_e4m3fn for k, v in got.items())
    expected = {}
    n_fp8 = 0
    for name, (owner, attr, rows) in _param_paths(s.model).items():
        if attr == "scale":
            continue
        if getattr(owner, "fp8", False) and attr == "weight":
            dense = np.asarray(owner.dense_weight())  # float32 W_e4m3 * scale, jds's own dequantisation
            dense = dense if rows is None else dense[rows[0]:rows[1]]  # a fused linear's part
            assert got[name].dtype == ml_dtypes.bfloat16
            np.testing.assert_allclose(got[name].astype(np.float32), dense, rtol=2.0 ** -8, atol=0, err_msg=name)
            expected[name] = dense.astype(ml_dtypes.bfloat16)  # rounded once: bit-equal to the converter's
            assert expected[name].tobytes() == got[name].tobytes(), name
            n_fp8 += 1
        else:
            expected[name] = export_weights(s.model)[name]
    assert n_fp8 == 7 * s.cfg.n_layers
    # the restored model is a bf16 model holding exactly jds's dequantised weights (same weights + same
    # config => the same logits; the fp8 model's own logits differ by its activation quantisation)
    restored = restore_model(out)
    assert restored.cfg == cfg and not restored.cfg.numerics.fp8_linear
    assert_same_weights(expected, export_weights(restored))


# ----- bad inputs ------------------------------------------------------------------------------------------
def _shard_of(hf: Path, name: str) -> Path:
    return hf / json.loads((hf / INDEX_NAME).read_text())["weight_map"][name]


def _rewrite_shard(hf: Path, name: str, fn: Callable[[dict[str, np.ndarray]], None], index: bool = False) -> None:
    """Apply ``fn`` to the tensors of ``name``'s shard and rewrite it (and the index when ``index``)."""
    path = _shard_of(hf, name)
    f = SafetensorsFile(path)
    tensors = {k: np.array(f.get(k)) for k in f.keys()}
    fn(tensors)
    write_safetensors(path, tensors)
    if index:
        idx = json.loads((hf / INDEX_NAME).read_text())
        idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if k in tensors or v != path.name}
        idx["weight_map"].update({k: path.name for k in tensors})
        (hf / INDEX_NAME).write_text(json.dumps(idx))


def _edit_config(hf: Path, fn: Callable[[dict], None]) -> None:
    d = json.loads((hf / "config.json").read_text())
    fn(d)
    (hf / "config.json").write_text(json.dumps(d))


L0 = "model.layers.0."
L1 = "model.layers.1."
Mutation = Callable[[Path], "str | None"]


def _remove(name: str, index: bool = True) -> Mutation:
    """Drop a tensor from its shard (and from the index unless ``index=False``)."""
    return lambda hf: _rewrite_shard(hf, name, lambda t: t.pop(name), index=index)


def _replace(name: str, fn: Callable[[np.ndarray], np.ndarray]) -> Mutation:
    return lambda hf: _rewrite_shard(hf, name, lambda t: t.__setitem__(name, fn(t[name])))


def _add(beside: str, name: str, arr: np.ndarray) -> Mutation:
    return lambda hf: _rewrite_shard(hf, beside, lambda t: t.__setitem__(name, arr), index=True)


def _config(fn: Callable[[dict], Any]) -> Mutation:
    return lambda hf: _edit_config(hf, fn)


def _truncate(hf: Path) -> str:
    """Cut the second shard to 60% of its size; return the pattern of the error (a tensor it held)."""
    idx = json.loads((hf / INDEX_NAME).read_text())["weight_map"]
    second = sorted(set(idx.values()))[1]
    path = hf / second
    with open(path, "r+b") as f:
        f.truncate(int(os.path.getsize(path) * 0.6))
    held = "|".join(re.escape(n) for n, s in idx.items() if s == second)
    return rf"tensor '({held})'.*truncated"


# case -> (how to damage a copy of the synthetic HF directory, the pattern the ValueError must match)
BAD_INPUTS: dict[str, tuple[Mutation, str | None]] = {
    # a tensor missing from both its shard and the index
    "missing_tensor": (_remove(L1 + "self_attn.kv_b_proj.weight"),
                       re.escape(f"missing tensor '{L1}self_attn.kv_b_proj.weight'")),
    # listed in the sharded index, absent from the shard file
    "missing_from_shard": (_remove(L0 + "mlp.experts.3.down_proj.weight", index=False),
                           re.escape(f"'{L0}mlp.experts.3.down_proj.weight' is listed")),
    "missing_scale": (_remove(L0 + "self_attn.o_proj.weight_scale_inv"),
                      re.escape(f"missing tensor '{L0}self_attn.o_proj.weight_scale_inv'")),
    "wrong_shape": (_replace(L0 + "self_attn.q_b_proj.weight", lambda a: a[:-1]),
                    re.escape(f"'{L0}self_attn.q_b_proj.weight' has shape (767, 256), expected (768, 256)")),
    "wrong_scale_shape": (_replace(L1 + "self_attn.kv_b_proj.weight_scale_inv", lambda a: a[:, :2]),
                          re.escape(f"'{L1}self_attn.kv_b_proj.weight_scale_inv' has shape (8, 2)")),
    "wrong_dtype_fp8_weight": (_replace(L0 + "self_attn.q_a_proj.weight", lambda a: a.astype(ml_dtypes.bfloat16)),
                               re.escape(f"'{L0}self_attn.q_a_proj.weight' has dtype BF16, expected F8_E4M3")),
    "wrong_dtype_norm": (_replace(L1 + "input_layernorm.weight", lambda a: a.astype(np.int32)),
                         re.escape(f"'{L1}input_layernorm.weight' has dtype I32")),
    "truncated_shard": (_truncate, None),
    "unexpected_tensor": (_add(L0 + "input_layernorm.weight", L0 + "self_attn.mystery.weight", np.zeros(4, np.float32)),
                          re.escape(f"tensor '{L0}self_attn.mystery.weight' has no place")),
    # config.json that does not match the tensors / lacks a field / describes what jds cannot hold
    "config_mismatch": (_config(lambda d: d.update(hidden_size=384)),
                        re.escape("'model.embed_tokens.weight' has shape (512, 256), expected (512, 384)")),
    "config_missing_field": (_config(lambda d: d.pop("num_attention_heads")), "num_attention_heads"),
    "config_mixed_dense_moe": (_config(lambda d: d.update(first_k_dense_replace=1)), "first_k_dense_replace"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_names_the_tensor_and_leaves_no_output(tmp_path, sources, case: str) -> None:
    s = sources("v32")
    hf = tmp_path / "hf"
    shutil.copytree(s.hf, hf)
    mutate, pattern = BAD_INPUTS[case]
    pattern = mutate(hf) or pattern
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=pattern):
        convert(hf, out, s.cfg.block_size)
    assert not out.exists() and no_temp_dirs(tmp_path)


def test_unexpected_tensors_can_be_allowed(tmp_path, sources) -> None:
    s = sources("v32")
    hf = tmp_path / "hf"
    shutil.copytree(s.hf, hf)
    BAD_INPUTS["unexpected_tensor"][0](hf)
    rep = convert(hf, tmp_path / "out", s.cfg.block_size, "--allow-unexpected")
    assert rep["skipped"]["not mapped (allowed)"] == [L0 + "self_attn.mystery.weight"]


def test_failure_mid_conversion_and_existing_output(tmp_path, sources, monkeypatch) -> None:
    s = sources("v32")
    out = tmp_path / "out"
    real, calls = hf_import._convert, []

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == 20:
            raise ValueError("HF tensor 'x': read error")
        return real(*a, **k)

    with monkeypatch.context() as m:
        m.setattr(hf_import, "_convert", flaky)
        with pytest.raises(ValueError, match="read error"):
            convert(s.hf, out, s.cfg.block_size, "--shard-mb", "0.5")
    assert not out.exists() and no_temp_dirs(tmp_path)
    convert(s.hf, out, s.cfg.block_size)
    with pytest.raises(ValueError, match="already exists"):
        convert(s.hf, out, s.cfg.block_size, "--layers", "1")
    convert(s.hf, out, s.cfg.block_size, "--layers", "1", "--overwrite")
    assert restore_model(out).cfg.n_layers == 1 and no_temp_dirs(tmp_path)


def test_restore_into_another_config_names_the_parameter(tmp_path, sources) -> None:
    s = sources("v32")
    out = tmp_path / "out"
    convert(s.hf, out, s.cfg.block_size)
    dense = dataclasses.replace(s.cfg, n_routed_experts=0)
    with pytest.raises(ValueError, match=r"'layers\.0\.ffn\.[\w.]+'.*'n_routed_experts'"):
        load_checkpoint(Decoder(dense), out)
    with pytest.raises(ValueError, match=r"parameter 'layers\.0\.[\w.]+'"):
        ModelRunner.build(preset="v32-tiny", checkpoint=str(out), num_blocks=2)


# ----- formats ---------------------------------------------------------------------------------------------
def test_safetensors_io_round_trip_and_errors(tmp_path) -> None:
    rng = np.random.default_rng(0)
    tensors = {
        "f32": rng.standard_normal((3, 5)).astype(np.float32),
        "bf16": rng.standard_normal((4,)).astype(ml_dtypes.bfloat16),
        "f16": rng.standard_normal((2, 2)).astype(np.float16),
        "e4m3": rng.standard_normal((2, 3)).astype(ml_dtypes.float8_e4m3fn),
        "e8m0": np.array([0.25, 1.0, 8.0], ml_dtypes.float8_e8m0fnu),
        "i32": np.arange(6, dtype=np.int32).reshape(2, 3),
        "i8": np.array([-1, 2], np.int8),
        "scalar": np.array(3.0, np.float32),
        "empty": np.zeros((0, 4), np.float32),
    }
    p = tmp_path / "a.safetensors"
    write_safetensors(p, tensors, metadata={"format": "pt"})
    f = SafetensorsFile(p)
    assert f.metadata == {"format": "pt"} and f.keys() == list(tensors)
    for k, v in tensors.items():
        got = f.get(k)
        assert got.dtype == v.dtype and got.shape == v.shape and got.tobytes() == v.tobytes(), k
    assert SafetensorsDir(tmp_path).info("e4m3") == ("F8_E4M3", (2, 3))  # no index: every file in the dir
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    with pytest.raises(ValueError, match="bad.safetensors.*not valid JSON"):
        SafetensorsFile(tmp_path / "bad.safetensors")
    with open(p, "r+b") as fh:
        fh.truncate(os.path.getsize(p) - 1)
    with pytest.raises(ValueError, match="tensor 'empty'|tensor 'scalar'"):
        SafetensorsFile(p).get("scalar")  # the last tensor with bytes ("scalar") lost its last byte


def test_fp4_experts_and_e8m0_scales_dequantise() -> None:
    # two e2m1 values per byte, low nibble first: 0x21 -> (0.5, 1.0); 0xF9 -> (-0.5, -6.0)
    packed = np.zeros((2, 16), np.uint8)
    packed[0, 0], packed[1, 15] = 0x21, 0xF9
    scale = np.array([[2.0], [0.25]], ml_dtypes.float8_e8m0fnu)  # one ue8m0 scale per 1x32 block
    w = hf_import.dequant_fp4_e2m1(packed.view(np.int8), scale)
    assert w.shape == (2, 32) and w.dtype == np.float32
    assert w[0, :2].tolist() == [1.0, 2.0] and w[1, 30:].tolist() == [-0.125, -1.5]
    assert np.count_nonzero(w) == 4
    s = np.array([[1.0, 0.5]], ml_dtypes.float8_e8m0fnu)
    q = np.ones((1, 256), ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(hf_import.dequant_fp8_blocks(q, s), np.repeat([[1.0, 0.5]], 128, axis=1))


def test_v4_config_in_transformers_spelling_maps_the_same() -> None:
    cfg = tiny_cfg("v4", moe=True)
    legacy = hf_import.hf_config_dict(cfg)
    modern = dict(legacy)
    ratio_type = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
    modern["layer_types"] = [ratio_type[r] for r in modern.pop("compress_ratios")]
    modern["partial_rotary_factor"] = modern.pop("qk_rope_head_dim") / modern["head_dim"]
    modern["rope_parameters"] = {
        "main": {"rope_type": "default", "rope_theta": modern.pop("rope_theta")},
        "compress": {"rope_theta": modern.pop("compress_rope_theta"), "rope_type": "yarn",
                     **{k: v for k, v in modern.pop("rope_scaling").items() if k != "type"}}}
    kw = dict(overrides={"block_size": cfg.block_size})
    assert hf_import.hf_model_config(modern, **kw) == hf_import.hf_model_config(legacy, **kw) == cfg


# ----- quantization_config and rope_scaling fields --------------------------------------------------------
def _qc(**kw: Any) -> Callable[[dict], None]:
    """Edit (value given) or drop (value None) quantization_config fields of a config.json dict."""
    def edit(d: dict) -> None:
        for k, v in kw.items():
            if v is None:
                d["quantization_config"].pop(k, None)
            else:
                d["quantization_config"][k] = v
    return edit


def _rope(**kw: Any) -> Callable[[dict], None]:
    return lambda d: d["rope_scaling"].update(kw)


V4_AMAX = r"'quantization_config\.scale_fmt': 'amax'.*DeepSeek-V4"
# case -> (config.json edit, the pattern of the ValueError)
BAD_QUANT: dict[str, tuple[Callable[[dict], None], str]] = {
    "scale_fmt_unknown": (_qc(scale_fmt="e5m2"), r"'quantization_config\.scale_fmt': 'e5m2'"),
    "fmt_unknown": (_qc(fmt="e5m2"), r"'quantization_config\.fmt': 'e5m2'"),
    "block_size": (_qc(weight_block_size=[64, 64]), r"'quantization_config\.weight_block_size': \[64, 64\]"),
    "activation_static": (_qc(activation_scheme="static"), r"'quantization_config\.activation_scheme': 'static'"),
    "quant_method": (_qc(quant_method="gptq"), r"'quantization_config\.quant_method': 'gptq'"),
    "not_an_object": (lambda d: d.update(quantization_config="fp8"), r"'quantization_config'"),
    "mscale_all_dim": (_rope(mscale=1.0, mscale_all_dim=0.707), r"'rope_scaling\.mscale_all_dim': 0\.707"),
}


@pytest.mark.parametrize("arch", ["v32", "v4"])
@pytest.mark.parametrize("case", list(BAD_QUANT))
def test_quantization_config_fields_are_validated(case: str, arch: str) -> None:
    """Every quantization_config field is read for V3.2 and V4; an unknown value is a ValueError naming the
    field, never a silent conversion."""
    cfg = tiny_cfg(arch, moe=False)
    d = hf_import.hf_config_dict(cfg)
    edit, pattern = BAD_QUANT[case]
    edit(d)
    with pytest.raises(ValueError, match=pattern):
        hf_import.hf_model_config(d, overrides={"block_size": cfg.block_size})


@pytest.mark.parametrize("arch", ["v32", "v4"])
def test_quantization_config_is_read_and_stored(arch: str) -> None:
    cfg = tiny_cfg(arch, moe=False)
    d = hf_import.hf_config_dict(cfg)
    assert d["quantization_config"]["scale_fmt"] == "ue8m0"  # what the released V3.2 / V4 configs say
    assert hf_import.quantization_config(d) == {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                                "weight_block_size": [128, 128], "activation_scheme": "dynamic",
                                                "defaulted": [], "unread": []}
    for k in ("fmt", "activation_scheme", "weight_block_size"):  # absent: the reference's defaults, said so
        d["quantization_config"].pop(k)
    d["quantization_config"]["modules_to_not_convert"] = None  # another key: reported, not interpreted
    q = hf_import.quantization_config(d)
    assert q["unread"] == ["modules_to_not_convert"]
    assert "not interpreted: modules_to_not_convert" in hf_import.describe_quantization(q)
    assert (q["fmt"], q["activation_scheme"], q["weight_block_size"]) == ("e4m3", "dynamic", [128, 128])
    assert q["defaulted"] == ["fmt", "weight_block_size", "activation_scheme"]
    assert "absent, taken as default" in hf_import.describe_quantization(q)
    kw = dict(overrides={"block_size": cfg.block_size})
    assert hf_import.hf_model_config(d, **kw).numerics.act_scale_fmt == "ue8m0"
    # absent scale_fmt = DeepSeek's plain amax/448 scales: V3.2 runs them in every activation quantiser
    # (linears, indexer q / k, latent records); V4, whose records store e8m0 exponents, refuses them
    d["quantization_config"].pop("scale_fmt")
    assert hf_import.quantization_config(d)["scale_fmt"] == "amax"
    for numerics in ("reference", "serving"):
        if arch == "v4":
            with pytest.raises(ValueError, match=V4_AMAX):
                hf_import.hf_model_config(d, numerics=numerics, **kw)
            continue
        n = hf_import.hf_model_config(d, numerics=numerics, **kw).numerics
        assert (n.act_scale_fmt, n.latent_scale_fmt) == ("amax", "amax")
    if arch == "v32":  # an explicit Numerics that disagrees with the checkpoint is refused, naming the field
        with pytest.raises(ValueError, match=r"numerics\.act_scale_fmt='ue8m0' differs.*scale_fmt"):
            hf_import.hf_model_config(d, numerics=Numerics.reference(), **kw)
    # equal mscale / mscale_all_dim (the released configs) is accepted; an unquantised checkpoint has none
    d = hf_import.hf_config_dict(cfg)
    d.setdefault("rope_scaling", {}).update(mscale=0.707, mscale_all_dim=0.707)
    hf_import.hf_model_config(d, **kw)
    assert hf_import.quantization_config(hf_import.hf_config_dict(cfg, fp8=False)) is None


def test_converted_checkpoint_records_quantization(tmp_path, sources, caplog, capsys) -> None:
    s = sources("v32")
    out = tmp_path / "out"
    with caplog.at_level("INFO", logger="jds.hf_import"):
        rep = convert(s.hf, out, s.cfg.block_size, "--layers", "1")
    want = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128],
            "activation_scheme": "dynamic", "defaulted": [], "unread": []}
    assert rep["quantization"] == want and read_meta(out)["extra"]["quantization"] == want
    assert "scale_fmt=ue8m0" in caplog.text and "scale_fmt=ue8m0" in capsys.readouterr().out
    hf = tmp_path / "hf"
    shutil.copytree(s.hf, hf)
    _edit_config(hf, _qc(scale_fmt=None))  # plain amax/448: converted, and the model runs that format
    rep = convert(hf, tmp_path / "out2", s.cfg.block_size, "--layers", "1")
    assert rep["quantization"]["scale_fmt"] == "amax"
    n = read_meta(tmp_path / "out2")["config"]["numerics"]
    assert (n["act_scale_fmt"], n["latent_scale_fmt"]) == ("amax", "amax")


# ----- DeepSeek-V4's block (ModelConfig.block == "v4") --------------------------------------------------
# The MTP module of the release (inference/model.py MTPBlock: e_proj, h_proj, enorm, hnorm, norm, its own HC
# head, and a whole Block), a sample of its tensors in the release's names.
MTP_TENSORS = ("mtp.0.e_proj.weight", "mtp.0.h_proj.weight", "mtp.0.enorm.weight", "mtp.0.hnorm.weight",
               "mtp.0.norm.weight", "mtp.0.hc_head_fn", "mtp.0.hc_head_base", "mtp.0.hc_head_scale",
               "mtp.0.hc_attn_fn", "mtp.0.attn.wq_a.weight", "mtp.0.ffn.gate.bias", "mtp.0.ffn.experts.0.w1.weight")


def v4_block_source(root: Path, seed: int = 7) -> tuple[Any, Decoder, Path]:
    """A V4-block tiny model (FP8 attention linears, bf16 experts) as a synthetic V4-Flash HF directory: the
    hyper-connections, HC head, router bias, hash table, per-expert tensors, plus MTP tensors."""
    cfg = dataclasses.replace(preset("v4-tiny-block"), numerics=tiny_cfg("v4", moe=False).numerics)
    model = Decoder(cfg, seed=seed)
    hf = root / "hf_v4_block"
    hf_import.export_hf(model, hf)
    rng = np.random.default_rng(seed)
    mtp = {n: rng.normal(size=(8, 8)).astype(np.float32) for n in MTP_TENSORS}
    _rewrite_shard(hf, "embed.weight", lambda t: t.update(mtp), index=True)
    return cfg, model, hf


def test_v4_block_synthetic_checkpoint_has_the_release_names(tmp_path) -> None:
    cfg, _, hf = v4_block_source(tmp_path)
    # wo_a is stored FP8 as released (the model runs it dequantised, in bf16)
    src = SafetensorsDir(hf)
    assert src.info("layers.1.attn.wo_a.weight")[0] == "F8_E4M3" and "layers.1.attn.wo_a.scale" in src
    names = set(json.loads((hf / INDEX_NAME).read_text())["weight_map"])
    for n in ("hc_head_fn", "hc_head_base", "hc_head_scale", "layers.0.hc_attn_fn", "layers.0.hc_attn_base",
              "layers.0.hc_attn_scale", "layers.2.hc_ffn_fn", "layers.0.ffn.gate.tid2eid", "layers.1.ffn.gate.bias",
              "layers.2.ffn.gate.weight", "layers.1.ffn.experts.7.w2.weight", "layers.1.ffn.shared_experts.w3.weight",
              "layers.1.attn.wo_a.scale"):
        assert n in names, n
    assert "layers.0.ffn.gate.bias" not in names and "layers.1.ffn.gate.tid2eid" not in names
    d = json.loads((hf / "config.json").read_text())
    assert (d["hc_mult"], d["num_hash_layers"], d["scoring_func"]) == (4, 1, "sqrtsoftplus")
    f = SafetensorsDir(hf)
    assert f.info("layers.0.ffn.gate.tid2eid") == ("I32", (cfg.vocab_size, cfg.moe_topk))
    assert f.info("layers.1.ffn.experts.0.w1.weight")[1] == (cfg.moe_intermediate_size, cfg.hidden_size)


@pytest.mark.slow  # two fused compiles of the 3-layer V4-block model
def test_v4_block_import_end_to_end(tmp_path) -> None:
    """Convert, restore, same weights and the same logits through the whole V4 block; every HF tensor is used
    except the MTP module's, which are rejected with their reason."""
    cfg, model, hf = v4_block_source(tmp_path)
    out = tmp_path / "out"
    rep = convert(hf, out, cfg.block_size)
    assert rep["config"] == cfg
    assert {k: sorted(v) for k, v in rep["skipped"].items()} == {hf_import.MTP_REJECTED: sorted(MTP_TENSORS)}
    all_names = set(SafetensorsDir(hf).names())
    assert set(rep["used"]) == all_names - set(MTP_TENSORS)
    restored = restore_model(out)
    assert restored.cfg == cfg
    assert_same_weights(export_weights(model), export_weights(restored))
    np.testing.assert_array_equal(step_logits(model, N_TOKENS["v4"]), step_logits(restored, N_TOKENS["v4"]))


def test_v4_block_import_weights_and_spellings(tmp_path) -> None:
    """The importer's mapping for the V4 block is bit-exact (weights compared, no forward), and accepts the
    HF-transformers spelling of the router bias (``e_score_correction_bias``)."""
    cfg, model, hf = v4_block_source(tmp_path, seed=3)
    assert hf_import.target_spec(cfg) == {k: (v.shape, v.dtype) for k, v in export_weights(model).items()}
    b = "layers.2.ffn.gate."
    _rewrite_shard(hf, b + "bias", lambda t: t.__setitem__(b + "e_score_correction_bias", t.pop(b + "bias")),
                   index=True)
    rep = hf_import.convert_hf_checkpoint(hf, tmp_path / "out", overrides={"block_size": cfg.block_size},
                                          progress=False)
    assert rep["config"] == cfg and list(rep["skipped"]) == [hf_import.MTP_REJECTED]
    assert b + "e_score_correction_bias" in rep["used"]
    assert_same_weights(export_weights(model), read_checkpoint(tmp_path / "out"))


V4_BLOCK_BAD: dict[str, tuple[Mutation, str]] = {
    # an FP4 release's experts import as stored (Numerics.experts_fp4), which needs 128-multiple widths; the FP4
    # import itself is tested in tests/test_v4_fp4_experts.py
    "fp4_experts_declared": (_config(lambda d: d.update(expert_dtype="fp4")),
                             re.escape("invalid config field 'moe_intermediate_size': must be a multiple of 128 "
                                       "with numerics.experts_fp4")),
    "missing_hc": (_remove("layers.2.hc_ffn_scale"), re.escape("missing tensor 'layers.2.hc_ffn_scale'")),
    "missing_hc_head": (_remove("hc_head_base"), re.escape("missing tensor 'hc_head_base'")),
    "missing_bias": (_remove("layers.1.ffn.gate.bias"), re.escape("missing tensor 'layers.1.ffn.gate.bias'")),
    "tid2eid_range": (_replace("layers.0.ffn.gate.tid2eid", lambda a: a + 8),
                      re.escape("'layers.0.ffn.gate.tid2eid': expert ids must lie in [0, 8)")),
    "tid2eid_float": (_replace("layers.0.ffn.gate.tid2eid", lambda a: a.astype(np.float32)),
                      re.escape("'layers.0.ffn.gate.tid2eid' has dtype F32, expected an integer tensor")),
    "tid2eid_shape": (_replace("layers.0.ffn.gate.tid2eid", lambda a: a[:, :1]),
                      re.escape("'layers.0.ffn.gate.tid2eid' has shape (512, 1), expected (512, 2)")),
    # a hash table on a layer the config says is score-routed has no place
    "hash_table_on_score_layer": (_add("layers.1.ffn.gate.bias", "layers.1.ffn.gate.tid2eid",
                                       np.zeros((512, 2), np.int32)),
                                  re.escape("tensor 'layers.1.ffn.gate.tid2eid' has no place")),
    "spellings_disagree": (_config(lambda d: d.update(route_scale=2.0)), "'routed_scaling_factor'"),
}


@pytest.fixture(scope="module")
def v4_block_hf(tmp_path_factory) -> Path:
    return v4_block_source(tmp_path_factory.mktemp("v4b"))[2]


@pytest.mark.parametrize("case", list(V4_BLOCK_BAD))
def test_v4_block_bad_input_names_the_tensor(tmp_path, v4_block_hf, case: str) -> None:
    assert_refused(tmp_path, v4_block_hf, *V4_BLOCK_BAD[case], run=lambda h, o: convert(h, o, 128))


def test_v4_without_hc_mult_keeps_the_v3_block_and_skips_with_reasons(tmp_path, v4_block_hf) -> None:
    """A V4 config.json without ``hc_mult`` describes jds's V3-style decoder around V4 attention; an explicit
    override picks either block."""
    d = json.loads((v4_block_hf / "config.json").read_text())
    assert hf_import.hf_model_config(d).block == "v4"
    d.pop("hc_mult")
    assert hf_import.hf_model_config(d).block == "v3"
    assert hf_import.hf_model_config(d, overrides={"block": "v4"}).block == "v4"
    assert hf_import.skip_reason("layers.0.hc_attn_fn", "v4", 3, "v3") is not None
    assert hf_import.skip_reason("layers.0.hc_attn_fn", "v4", 3, "v4") is None
    assert hf_import.skip_reason("mtp.0.e_proj.weight", "v4", 3, "v4") == hf_import.MTP_REJECTED


# ----- config.json values of the wrong type, and the command line's own checks ------------------------------
def _modern_v4() -> dict:
    """tiny V4 (MoE) config.json in transformers' spelling (as in the test above)."""
    legacy = hf_import.hf_config_dict(tiny_cfg("v4", moe=True))
    modern = dict(legacy)
    ratio_type = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
    modern["layer_types"] = [ratio_type[r] for r in modern.pop("compress_ratios")]
    modern["rope_parameters"] = {"main": {"rope_theta": modern.pop("rope_theta")},
                                 "compress": {"rope_theta": modern.pop("compress_rope_theta"), "rope_type": "yarn",
                                              **{k: v for k, v in modern.pop("rope_scaling").items() if k != "type"}}}
    return modern


@pytest.mark.parametrize("base,edit,pattern", [
    ("v32", dict(n_routed_experts="many"), "'n_routed_experts': expected an integer, got 'many'"),
    ("v32", dict(n_routed_experts=-4), "'n_routed_experts': -4 must be >= 0"),
    ("v32", dict(first_k_dense_replace="x"), "'first_k_dense_replace': expected an integer, got 'x'"),
    ("block", dict(hc_eps=[1e-6]), "'hc_eps': expected a number, got [1e-06]"),
    ("block", dict(routed_scaling_factor="big"), "'routed_scaling_factor': expected a number, got 'big'"),
    ("modern", dict(layer_types="sliding_attention"), "'layer_types': expected a list"),
    ("modern", dict(compress_rates=[4]), "'compress_rates': expected a JSON object"),
    ("modern", dict(compress_rates={"compressed_sparse_attention": "four"}),
     "'compress_rates.compressed_sparse_attention': expected an integer"),
    ("modern", dict(rope_parameters={"main": 1, "compress": {"rope_theta": 1e5}}),
     "'rope_parameters.main': expected a JSON object, got 1"),
])
def test_config_value_of_the_wrong_type_names_the_field(base: str, edit: dict, pattern: str) -> None:
    """Before: int() / float() / .get() on the raw value (a TypeError / AttributeError traceback, or a ValueError
    naming no field)."""
    d = {"v32": lambda: hf_import.hf_config_dict(tiny_cfg("v32", moe=True)),
         "block": lambda: hf_import.hf_config_dict(preset("v4-tiny-block")), "modern": _modern_v4}[base]()
    with pytest.raises(ValueError, match=re.escape(f"invalid config field {pattern}")):
        hf_import.hf_model_config({**d, **edit})


def test_unreadable_directory_files_name_the_file(tmp_path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="config.json is not a JSON object"):
        convert(hf, tmp_path / "out", 64)
    (hf / "config.json").write_bytes(b"\xff\xfe{")
    with pytest.raises(ValueError, match=r"cannot read config\.json \('utf-8' codec"):
        convert(hf, tmp_path / "out", 64)
    write_safetensors(tmp_path / "m.safetensors", {"a": np.zeros(2, np.float32)})
    raw = (tmp_path / "m.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["__metadata__"] = ["pt"]
    text = json.dumps(header).encode()
    (tmp_path / "m.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    with pytest.raises(ValueError, match="__metadata__ is not a JSON object"):
        SafetensorsFile(tmp_path / "m.safetensors")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv,pattern", [
    (["--shard-mb", "0"], "argument --shard-mb: must be a finite number > 0"),
    (["--shard-mb", "nan"], "argument --shard-mb: must be a finite number > 0"),  # was "cannot convert float NaN"
    (["--shard-mb", "x"], "argument --shard-mb: expected a number"),
    (["--override", "block_size"], "expected KEY=VALUE"),
])
def test_convert_flag_errors(tmp_path, argv, pattern, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        CONVERT.main([str(tmp_path / "hf"), str(tmp_path / "out"), *argv])
    assert e.value.code == 2 and pattern in capsys.readouterr().err
    with pytest.raises(SystemExit):
        CONVERT.main([str(tmp_path / "hf"), ""])
    assert "out must not be empty" in capsys.readouterr().err


def test_v4_compressors_held_as_stored(tmp_path) -> None:
    """A V4 checkpoint whose compressor weights are F32 imports with ``compressor_float32`` (held and multiplied in
    float32, as stored); one that stores them bf16 holds them in the activation dtype. An explicit Numerics is
    left as given."""
    d = hf_import.hf_config_dict(tiny_cfg("v4", moe=False))
    kw = dict(overrides={"block_size": 128})
    assert hf_import.hf_model_config(d, stored_compressor="F32", **kw).numerics.compressor_float32
    assert not hf_import.hf_model_config(d, stored_compressor="BF16", **kw).numerics.compressor_float32
    explicit = Numerics.reference()
    assert hf_import.hf_model_config(d, numerics=explicit, stored_compressor="F32", **kw).numerics == explicit
    for f32 in (True, False):  # the dtype read from a synthetic directory's headers
        cfg = tiny_cfg("v4", moe=False, numerics=dataclasses.replace(Numerics.reference(), compressor_float32=f32))
        hf = tmp_path / f"hf_{f32}"
        hf_import.export_hf(Decoder(cfg, seed=3), hf, n_shards=1)
        want = "F32" if f32 else "BF16"
        hf_cfg = json.loads((hf / "config.json").read_text())
        assert hf_import._stored_compressor_dtype(SafetensorsDir(hf), hf_cfg) == want


@pytest.mark.parametrize("arch", ["v32", "v4"])
def test_weights_proj_held_as_stored(tmp_path, arch: str) -> None:
    """An indexer ``weights_proj`` stored F32 imports with ``weights_proj_float32`` (held and multiplied in float32);
    one stored bf16 (the checkpoints seen) is held in the activation dtype. An explicit Numerics is left as given."""
    d = hf_import.hf_config_dict(tiny_cfg(arch, moe=False))
    kw = dict(overrides={"block_size": 128}) if arch == "v4" else {}
    assert hf_import.hf_model_config(d, stored_weights_proj="F32", **kw).numerics.weights_proj_float32
    assert not hf_import.hf_model_config(d, stored_weights_proj="BF16", **kw).numerics.weights_proj_float32
    explicit = Numerics.reference()
    assert hf_import.hf_model_config(d, numerics=explicit, stored_weights_proj="F32", **kw).numerics == explicit
    for f32 in (True, False):  # the dtype read from a synthetic directory's headers
        cfg = tiny_cfg(arch, moe=False, numerics=dataclasses.replace(Numerics.reference(), weights_proj_float32=f32))
        hf = tmp_path / f"hf_{f32}"
        hf_import.export_hf(Decoder(cfg, seed=3), hf, n_shards=1)
        hf_cfg = json.loads((hf / "config.json").read_text())
        assert hf_import._stored_weights_proj_dtype(SafetensorsDir(hf), hf_cfg) == ("F32" if f32 else "BF16")
