"""Config presets against the spec numbers, HF config.json loading, and validation messages (no JAX)."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest

from jds.config import Numerics, RopeConfig, V32Config, V4Config, replace, yarn_mscale

# DeepSeek-V3.2 config.json attention fields (spec §1; HF field names)
V32_HF = {
    "hidden_size": 7168, "num_attention_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048,
    "rope_theta": 10000, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "num_hidden_layers": 61, "vocab_size": 129280,  # unrelated fields are ignored
}

# DeepSeek-V4-Flash config.json attention fields (V4 spec §1)
V4_RATIOS = [0, 0] + [4 if i % 2 == 0 else 128 for i in range(2, 43)] + [0]
V4_HF = {
    "hidden_size": 4096, "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
    "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_lora_rank": 1024, "o_groups": 8, "sliding_window": 128,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "rms_norm_eps": 1e-6,
    "rope_theta": 10000, "compress_rope_theta": 160000, "max_position_embeddings": 1048576,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "compress_ratios": V4_RATIOS, "num_hidden_layers": 43,
}


def write_json(tmp_path, d: dict):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(d))
    return p


# ------------------------------------------------------------------------------------------
# presets
# ------------------------------------------------------------------------------------------


def test_v32_preset_spec_values() -> None:
    c = V32Config.deepseek_v32()
    assert (c.hidden_size, c.n_heads, c.q_lora_rank, c.kv_lora_rank) == (7168, 128, 1536, 512)
    assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.qk_head_dim) == (128, 64, 128, 192)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk) == (64, 128, 2048)
    assert (c.rope_theta, c.rope_factor, c.original_seq_len, c.beta_fast, c.beta_slow, c.mscale) == \
        (10000.0, 40.0, 4096, 32.0, 1.0, 1.0)
    assert c.max_seq_len == 163840 and c.rms_norm_eps == 1e-6 and c.kv_record_dim == 576
    assert c.yarn_active
    assert c.rope == RopeConfig(10000.0, True, 40.0, 4096, 32.0, 1.0)
    assert abs(yarn_mscale(c.rope_factor, c.mscale) - 1.3688879454113936) < 1e-15
    assert abs(c.softmax_scale - 0.1352337788608801) < 1e-12
    assert abs(c.softmax_scale - 192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2) < 1e-15


def test_v32_yarn_pitfall_short_max_seq_len() -> None:
    """[R]: YaRN (frequencies and mscale) only when max_seq_len > original_seq_len (spec §1 pitfall)."""
    c = replace(V32Config(), max_seq_len=4096)
    assert not c.yarn_active and not c.rope.yarn
    assert c.softmax_scale == 192 ** -0.5
    assert replace(V32Config(), rope_factor=1.0).softmax_scale == 192 ** -0.5


def test_v4_flash_preset_spec_values() -> None:
    c = V4Config.deepseek_v4_flash()
    assert (c.hidden_size, c.n_heads, c.head_dim, c.rope_head_dim) == (4096, 64, 512, 64)
    assert (c.q_lora_rank, c.o_lora_rank, c.o_groups, c.window_size) == (1024, 1024, 8, 128)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk) == (64, 128, 512)
    assert c.rms_norm_eps == 1e-6 and c.max_seq_len == 1048576
    assert c.compress_ratios == tuple(V4_RATIOS)
    assert len(c.compress_ratios) == 44 and c.n_layers == 44
    assert c.compress_ratios[:4] == (0, 0, 4, 128) and c.compress_ratios[-2:] == (4, 0)
    assert [i for i, r in enumerate(c.compress_ratios) if r == 4] == list(range(2, 43, 2))  # 21 C4 layers
    assert [i for i, r in enumerate(c.compress_ratios) if r == 128] == list(range(3, 42, 2))  # 20 C128 layers
    assert c.window_rope == RopeConfig(theta=10000.0, yarn=False)
    assert c.compressed_rope == RopeConfig(160000.0, True, 16.0, 65536, 32.0, 1.0)
    assert c.rope_for(0) == c.window_rope and c.rope_for(4) == c.rope_for(128) == c.compressed_rope
    assert c.softmax_scale == 512 ** -0.5


def test_tiny_presets_validate() -> None:
    t = V32Config.tiny()
    assert (t.kv_lora_rank, t.qk_rope_head_dim, t.index_head_dim) == (512, 64, 128)  # real record sizes
    assert t.yarn_active
    v = V4Config.tiny()
    assert (v.head_dim, v.rope_head_dim) == (512, 64) and v.compress_ratios == (0, 4, 128)


def test_numerics_presets() -> None:
    e = Numerics.exact()
    assert (e.dtype, e.kv_cache_dtype, e.fp8_linear, e.indexer_fp8) == ("float32", "float32", False, False)
    r = Numerics.reference()
    assert (r.dtype, r.kv_cache_dtype, r.fp8_linear, r.indexer_fp8, r.indexer_hadamard) == \
        ("bfloat16", "fp8", True, True, True)
    assert Numerics.serving().indexer_hadamard is False


# ------------------------------------------------------------------------------------------
# from_hf_config
# ------------------------------------------------------------------------------------------


def test_v32_from_hf_config_reproduces_preset(tmp_path) -> None:
    p = write_json(tmp_path, V32_HF)
    assert V32Config.from_hf_config(p) == V32Config.deepseek_v32()
    assert V32Config.from_hf_config(tmp_path) == V32Config.deepseek_v32()  # a directory holding config.json
    assert V32Config.from_hf_config(str(p)) == V32Config.deepseek_v32()
    d = dict(V32_HF, rope_scaling=dict(V32_HF["rope_scaling"]))
    del d["rope_scaling"]["type"]
    d["rope_scaling"]["rope_type"] = "yarn"  # newer transformers spelling
    assert V32Config.from_hf_config(d) == V32Config.deepseek_v32()
    assert V32Config.from_hf_config(p, block_size=32).block_size == 32  # overrides


def test_v32_from_hf_config_default_rope(tmp_path) -> None:
    d = {k: v for k, v in V32_HF.items() if k != "rope_scaling"}
    c = V32Config.from_hf_config(write_json(tmp_path, d))
    assert c.rope_factor == 1.0 and not c.yarn_active and c.softmax_scale == 192 ** -0.5


def test_v4_from_hf_config_reproduces_preset(tmp_path) -> None:
    p = write_json(tmp_path, V4_HF)
    assert V4Config.from_hf_config(p) == V4Config.deepseek_v4_flash()
    assert V4Config.from_hf_config(tmp_path) == V4Config.deepseek_v4_flash()
    assert V4Config.from_hf_config(dict(V4_HF)) == V4Config.deepseek_v4_flash()


# config.json key -> the jds field named in the error (the message names the config.json key too)
V32_REQUIRED = {"hidden_size": "hidden_size", "num_attention_heads": "n_heads", "q_lora_rank": "q_lora_rank",
                "kv_lora_rank": "kv_lora_rank", "qk_nope_head_dim": "qk_nope_head_dim",
                "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim", "index_n_heads": "index_n_heads",
                "index_head_dim": "index_head_dim", "index_topk": "index_topk",
                "max_position_embeddings": "max_seq_len"}
V4_REQUIRED = {"hidden_size": "hidden_size", "num_attention_heads": "n_heads", "head_dim": "head_dim",
               "qk_rope_head_dim": "rope_head_dim", "q_lora_rank": "q_lora_rank", "o_lora_rank": "o_lora_rank",
               "o_groups": "o_groups", "sliding_window": "window_size", "index_n_heads": "index_n_heads",
               "index_head_dim": "index_head_dim", "index_topk": "index_topk",
               "max_position_embeddings": "max_seq_len", "compress_ratios": "compress_ratios"}


@pytest.mark.parametrize("field", sorted(V32_REQUIRED))
def test_v32_missing_field(tmp_path, field: str) -> None:
    d = {k: v for k, v in V32_HF.items() if k != field}
    with pytest.raises(ValueError, match="missing from config.json") as e:
        V32Config.from_hf_config(write_json(tmp_path, d))
    assert f"invalid config field '{V32_REQUIRED[field]}'" in str(e.value) and f"'{field}'" in str(e.value)


@pytest.mark.parametrize("field", sorted(V4_REQUIRED))
def test_v4_missing_field(tmp_path, field: str) -> None:
    d = {k: v for k, v in V4_HF.items() if k != field}
    with pytest.raises(ValueError, match="missing from config.json") as e:
        V4Config.from_hf_config(write_json(tmp_path, d))
    assert f"invalid config field '{V4_REQUIRED[field]}'" in str(e.value) and f"'{field}'" in str(e.value)


@pytest.mark.parametrize("hf_field,value,name", [
    ("num_attention_heads", 0, "n_heads"),
    ("kv_lora_rank", 500, "kv_lora_rank"),
    ("qk_rope_head_dim", 63, "qk_rope_head_dim"),
    ("index_head_dim", 64, "index_head_dim"),
    ("rms_norm_eps", 0.0, "rms_norm_eps"),
    ("rope_theta", -1.0, "rope_theta"),
])
def test_v32_invalid_hf_value(tmp_path, hf_field: str, value, name: str) -> None:
    with pytest.raises(ValueError, match=f"'{name}'"):
        V32Config.from_hf_config(write_json(tmp_path, dict(V32_HF, **{hf_field: value})))


# ------------------------------------------------------------------------------------------
# validation: each invalid value raises ValueError naming its field
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field,value", [
    ("hidden_size", 0), ("hidden_size", 7000), ("n_heads", -4), ("n_heads", 2.0), ("q_lora_rank", 1000),
    ("kv_lora_rank", 0), ("kv_lora_rank", 500), ("qk_nope_head_dim", 0), ("qk_rope_head_dim", 63),
    ("v_head_dim", 0), ("index_n_heads", 0), ("index_head_dim", 64), ("index_head_dim", 200), ("index_topk", 0),
    ("max_seq_len", 0), ("block_size", 0), ("rms_norm_eps", 0.0), ("rope_factor", 0.5), ("rope_theta", 0.0),
    ("beta_fast", 0.5), ("n_heads", True),
])
def test_v32_invalid_field(field: str, value) -> None:
    with pytest.raises(ValueError, match=f"invalid config field '{field}'"):
        replace(V32Config(), **{field: value})


@pytest.mark.parametrize("field,value", [
    ("hidden_size", 0), ("n_heads", 0), ("head_dim", -512), ("rope_head_dim", 63), ("rope_head_dim", 512),
    ("q_lora_rank", 0), ("o_lora_rank", 0), ("o_groups", 3), ("o_groups", 0), ("window_size", 0),
    ("index_n_heads", 0), ("index_head_dim", 64), ("index_topk", 0), ("compress_ratios", ()),
    ("compress_ratios", [0, 4]), ("compress_ratios", (0, 3)), ("compress_ratios", (0, 512)), ("block_size", 0),
    ("quant_block", 0), ("quant_block", 60), ("rms_norm_eps", -1e-6), ("max_seq_len", 0),
    ("compress_rope_theta", 0.0), ("rope_theta", -1.0), ("rope_factor", 0.5), ("beta_fast", 0.5),
])
def test_v4_invalid_field(field: str, value) -> None:
    with pytest.raises(ValueError, match=f"invalid config field '{field}'"):
        replace(V4Config(), **{field: value})


@pytest.mark.parametrize("field,value", [("dtype", "float16"), ("kv_cache_dtype", "int8"),
                                         ("latent_scale_fmt", "e8m0")])
def test_numerics_invalid_field(field: str, value) -> None:
    with pytest.raises(ValueError, match=f"invalid config field '{field}'"):
        dataclasses.replace(Numerics(), **{field: value})


# ------------------------------------------------------------------------------------------
# ModelConfig, presets and their JSON form; RunnerConfig
# ------------------------------------------------------------------------------------------
from jds.config import PRESETS, ModelConfig, RunnerConfig, load_model_config, preset  # noqa: E402


def _model_variants() -> list[ModelConfig]:
    out = [preset(name) for name in PRESETS]
    out.append(preset("v4-tiny", n_layers=2, n_routed_experts=8, moe_topk=2, numerics=Numerics.reference()))
    out.append(dataclasses.replace(preset("v32-tiny"), numerics=Numerics.serving(), bos_token_id=0, eos_token_id=1))
    return out


@pytest.mark.parametrize("cfg", _model_variants(), ids=lambda c: f"{c.arch}-{c.n_layers}-{c.n_routed_experts}")
def test_model_config_json_round_trip(cfg: ModelConfig) -> None:
    """to_dict / to_json and back give an equal config (tuples survive JSON's lists)."""
    d = cfg.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert ModelConfig.from_dict(d) == cfg
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    if cfg.arch == "v4":
        assert isinstance(ModelConfig.from_dict(d).attn.compress_ratios, tuple)


@pytest.mark.parametrize("edit,field", [
    (lambda d: d.update(arch="v5"), "arch"),
    (lambda d: d.pop("arch"), "arch"),
    (lambda d: d.pop("n_layers"), "n_layers"),
    (lambda d: d.update(layers=2), "layers"),
    (lambda d: d["attn"].update(window=3), "attn.window"),
    (lambda d: d["numerics"].update(fp16=True), "numerics.fp16"),
    (lambda d: d.update(attn=[1, 2]), "attn"),
    (lambda d: d["attn"].update(index_topk=0), "index_topk"),
    (lambda d: d.update(n_layers=0), "n_layers"),
])
def test_model_config_from_dict_names_the_bad_field(edit, field: str) -> None:
    d = preset("v32-tiny").to_dict()
    edit(d)
    with pytest.raises(ValueError, match=f"invalid config field '{re.escape(field)}'"):
        ModelConfig.from_dict(d)


def test_model_config_from_json_rejects_bad_json() -> None:
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_json("{arch: v32")


@pytest.mark.parametrize("field,value", [
    ("n_layers", 0), ("n_layers", 2.0), ("vocab_size", 100), ("intermediate_size", 0), ("n_routed_experts", -1),
    ("numerics", "bf16"), ("attn", V4Config.tiny()), ("arch", "v5"), ("bos_token_id", -1),
])
def test_model_config_invalid_field(field: str, value) -> None:
    with pytest.raises(ValueError, match=f"invalid config field '{field}'"):
        replace(preset("v32-tiny"), **{field: value})


@pytest.mark.parametrize("field,value", [("moe_topk", 9), ("moe_topk", 0), ("n_shared_experts", 0),
                                         ("moe_intermediate_size", 0)])
def test_moe_fields_checked_when_moe(field: str, value) -> None:
    with pytest.raises(ValueError, match=f"invalid config field '{field}'"):
        preset("v32-tiny", n_routed_experts=8, **{field: value})
    assert preset("v32-tiny", **{field: value}).n_routed_experts == 0  # dense: the MoE fields are unused


def test_presets_and_overrides() -> None:
    assert [preset(n).arch for n in PRESETS] == ["v32", "v4", "v4", "v32", "v4"]
    with pytest.raises(ValueError, match="unknown preset 'v33-tiny'"):
        preset("v33-tiny")
    with pytest.raises(ValueError, match="invalid config field 'moe'"):  # no shortcut flags in the library
        preset("v32-tiny", moe=True)
    cfg = load_model_config("v4-tiny", n_routed_experts=4, moe_topk=1)
    assert (cfg.arch, cfg.n_routed_experts, cfg.moe_topk, cfg.n_shared_experts) == ("v4", 4, 1, 1)
    assert load_model_config() == preset("v32-tiny")


def test_load_model_config_takes_hf_attention(tmp_path) -> None:
    cfg = load_model_config("v32-bench", write_json(tmp_path, V32_HF))
    assert cfg.attn == V32Config.deepseek_v32() and cfg.n_layers == preset("v32-bench").n_layers


def test_runner_config_defaults_and_normalisation() -> None:
    opts = {"xla_gpu_enable_command_buffer": "FUSION"}
    rc = RunnerConfig(token_buckets=[16, 64], key_block_buckets=[2], captured_compiler_options=opts)
    assert rc.token_buckets == (16, 64) and rc.key_block_buckets == (2,)
    opts["xla_gpu_enable_command_buffer"] = ""  # the config keeps its own copy
    assert rc.captured_compiler_options == {"xla_gpu_enable_command_buffer": "FUSION"}
    assert RunnerConfig() == RunnerConfig(mode="narrow", num_blocks=256, max_num_seqs=16, max_num_tokens=256,
                                          max_model_len=1024)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rc.mode = "fused"  # type: ignore[misc]
    assert replace(rc, mode="fused", segments=2).segments == 2


@pytest.mark.parametrize("field,kw", [
    ("mode", {"mode": "eager"}), ("input_prep", {"input_prep": "gpu"}), ("num_blocks", {"num_blocks": 0}),
    ("max_num_seqs", {"max_num_seqs": -1}), ("max_num_tokens", {"max_num_tokens": 2.0}),
    ("max_model_len", {"max_model_len": 0}), ("segments", {"segments": 0}),
    ("update_capacity", {"update_capacity": -1}), ("stable_inputs", {"stable_inputs": "yes"}),
    ("batch_invariant", {"batch_invariant": 1}), ("all_eager", {"all_eager": None}),
    ("token_buckets", {"token_buckets": (0,)}), ("token_buckets", {"token_buckets": (512,)}),
    ("token_buckets", {"token_buckets": 16}), ("key_block_buckets", {"key_block_buckets": (0,)}),
    ("segments", {"segments": 2}), ("segments", {"segments": 2, "mode": "fused", "input_prep": "host"}),
    ("captured_compiler_options", {"captured_compiler_options": "FUSION"}),
    ("eager_compiler_options", {"eager_compiler_options": {"xla_dump_to": ["a"]}}),
    ("dump_dir", {"dump_dir": ""}),
    ("dump_dir", {"dump_dir": "/tmp/d", "captured_compiler_options": {"xla_dump_to": "/tmp/e"}}),
    ("nmu_blocks", {"nmu_blocks": 4}),
])
def test_runner_config_invalid_field(field: str, kw: dict) -> None:
    with pytest.raises(ValueError, match=f"invalid config field '{field}'"):
        replace(RunnerConfig(), **kw)


# ------------------------------------------------------------------------------------------
# a config.json that cannot be read, or a value of the wrong type: a ValueError naming the file or field
# ------------------------------------------------------------------------------------------
def test_unreadable_config_json_names_the_file(tmp_path) -> None:
    from jds.config import load_model_config

    with pytest.raises(ValueError, match=r"config '.*nope\.json': cannot read it as JSON \(No such file"):
        V32Config.from_hf_config(tmp_path / "nope.json")
    (tmp_path / "config.json").write_text('{"hidden_size": ')
    with pytest.raises(ValueError, match=r"config '.*config\.json': cannot read it as JSON"):
        V32Config.from_hf_config(tmp_path)  # a directory: its config.json
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object, got list"):
        load_model_config("v32-tiny", tmp_path / "config.json")


@pytest.mark.parametrize("cls,edit,pattern", [
    (V32Config, dict(rope_theta=None), "'rope_theta': expected a number, got None"),
    (V32Config, dict(rms_norm_eps="small"), "'rms_norm_eps': expected a number, got 'small'"),
    (V32Config, dict(rope_scaling="yarn"), "'rope_scaling': expected a JSON object, got 'yarn'"),
    (V32Config, dict(rope_scaling=dict(V32_HF["rope_scaling"], factor=[40])),
     "'rope_scaling.factor': expected a number"),
    (V32Config, dict(rope_scaling=dict(V32_HF["rope_scaling"], original_max_position_embeddings=4096.5)),
     "'rope_scaling.original_max_position_embeddings': expected an integer"),
    (V32Config, dict(rope_scaling=dict(V32_HF["rope_scaling"], mscale=None)), "'rope_scaling.mscale'"),
    (V32Config, dict(indexer_rope_interleave="false"), "'indexer_rope_interleave': expected true or false"),
    (V4Config, dict(compress_rope_theta=[1]), "'compress_rope_theta': expected a number"),
    (V4Config, dict(compress_ratios=4), "'compress_ratios': expected a list of integers, got 4"),
    (V4Config, dict(compress_ratios=[0, "x"]), "'compress_ratios': expected an integer, got 'x'"),
    (V4Config, dict(rope_scaling=[1]), "'rope_scaling': expected a JSON object"),
    (V4Config, dict(rope_scaling=dict(V4_HF["rope_scaling"], beta_fast={})), "'rope_scaling.beta_fast'"),
])
def test_hf_value_of_the_wrong_type_names_the_field(cls, edit: dict, pattern: str) -> None:
    """Before: TypeError / AttributeError tracebacks, or a ValueError from float() naming no field."""
    base = V32_HF if cls is V32Config else V4_HF
    with pytest.raises(ValueError, match=re.escape(f"invalid config field {pattern}")):
        cls.from_hf_config(dict(base, **edit))


def test_hf_numbers_as_before() -> None:
    """Integral floats and numeric strings read as they did (int() / float() of them)."""
    rs = dict(V32_HF["rope_scaling"], original_max_position_embeddings=4096.0, factor="40")
    a = V32Config.from_hf_config(dict(V32_HF, rope_scaling=rs, rope_theta="10000"))
    assert a == V32Config.from_hf_config(V32_HF)
