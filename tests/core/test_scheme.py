"""QuantScheme: validation, presets, dict/JSON round trips, compressed-tensors field names."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lowbit as lb
from lowbit.scheme import PRESETS, SCALE_ROUNDINGS, QuantScheme, get_preset

INT_FORMATS = ["int8", "int4", "int2"]
FLOAT_FORMATS = ["fp8_e4m3fn", "fp8_e4m3fnuz", "fp8_e5m2", "fp8_e5m2fnuz", "fp6_e2m3fn", "fp6_e3m2fn", "fp4_e2m1fn"]


def test_public_names():
    assert lb.QuantScheme is QuantScheme and lb.get_preset is get_preset and lb.PRESETS is PRESETS


def test_presets_are_what_their_names_say():
    expect = {
        "mxfp8": ("fp8_e4m3fn", 32, "e8m0"), "mxfp6_e2m3": ("fp6_e2m3fn", 32, "e8m0"),
        "mxfp6_e3m2": ("fp6_e3m2fn", 32, "e8m0"), "mxfp4": ("fp4_e2m1fn", 32, "e8m0"),
        "nvfp4": ("fp4_e2m1fn", 16, "fp8_e4m3fn"), "int4_g128": ("int4", 128, "fp32"),
        "int4_g128_asym": ("int4", 128, "fp32"),
    }
    for name, (fmt, g, sf) in expect.items():
        s = get_preset(name)
        assert (s.format, s.strategy, s.group_size, s.scale_format) == (fmt, "group", g, sf), name
    assert get_preset("int4_g128_asym").symmetric is False and get_preset("int4_g128").symmetric is True
    assert get_preset("int8_channel").strategy == "channel" and get_preset("int8_token").strategy == "token"
    assert get_preset("fp8_tensor").strategy == "tensor" and get_preset("fp8_row").strategy == "channel"
    assert get_preset("fp8_block128").block_size == (128, 128)
    assert get_preset("fp8_block1x128").block_size == (1, 128)
    assert get_preset("mxfp8").scale_rounding in SCALE_ROUNDINGS
    assert get_preset("nvfp4").two_level and not get_preset("mxfp8").two_level
    with pytest.raises(ValueError, match="unknown preset 'mxfp9'.*mxfp8"):
        get_preset("mxfp9")


def test_derived_properties():
    s = QuantScheme("int4", "group", group_size=64)
    assert (s.num_bits, s.type, s.fmt.name) == (4, "int", "int4")
    s = QuantScheme("fp6_e3m2fn", "tensor")
    assert (s.num_bits, s.type) == (6, "float")


@pytest.mark.parametrize("kwargs, match", [
    (dict(format="int8", strategy="group"), "group_size"),
    (dict(format="int8", strategy="group", group_size=0), "group_size"),
    (dict(format="int8", strategy="channel", group_size=32), "only applies to strategy='group'"),
    (dict(format="int8", strategy="block"), "block_size"),
    (dict(format="int8", strategy="block", block_size=(128,)), "block_size"),
    (dict(format="int8", strategy="tensor", block_size=(1, 128)), "only applies to strategy='block'"),
    (dict(format="int8", strategy="row"), "strategy must be one of"),
    (dict(format="int9", strategy="tensor"), "unknown format 'int9'"),
    (dict(format="e8m0fnu", strategy="tensor"), "scale-only"),
    (dict(format="fp16", strategy="tensor"), "at most 8 bits"),
    (dict(format="fp8_e4m3fn", strategy="tensor", symmetric=False), "only defined for integer"),
    (dict(format="uint4", strategy="group", group_size=32), "needs symmetric=False"),
    (dict(format="fp8_e4m3fn", strategy="channel", scale_format="e8m0", scale_rounding="floor"), "group' or 'block"),
    (dict(format="int8", strategy="group", group_size=32, scale_format="e8m0", scale_rounding="floor"), "float element"),
    (dict(format="fp8_e4m3fn", strategy="group", group_size=32, scale_format="e8m0"), "needs scale_rounding"),
    (dict(format="fp8_e4m3fn", strategy="group", group_size=32, scale_format="e8m0", scale_rounding="up"), "needs scale_rounding"),
    (dict(format="fp8_e4m3fn", strategy="tensor", scale_rounding="floor"), "only applies to scale_format='e8m0'"),
    (dict(format="fp8_e4m3fn", strategy="group", group_size=16, scale_format="fp16"), "scale_format must be one of"),
    (dict(format="int8", strategy="tensor", symmetric="yes"), "symmetric must be True or False"),
])
def test_bad_schemes_name_the_argument(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        QuantScheme(**kwargs)


def test_frozen_and_hashable():
    s = get_preset("mxfp4")
    with pytest.raises(Exception):
        s.group_size = 16
    assert hash(s) == hash(QuantScheme.from_dict(s.to_dict()))


def test_block_size_list_normalized_to_tuple():
    s = QuantScheme("fp8_e4m3fn", "block", block_size=[128, 64])
    assert s.block_size == (128, 64)


def test_dict_uses_compressed_tensors_names():
    d = get_preset("fp8_block128").to_dict()
    for key in ("num_bits", "type", "strategy", "group_size", "block_structure", "symmetric", "dynamic"):
        assert key in d
    assert d["block_structure"] == [128, 128] and d["type"] == "float" and d["num_bits"] == 8
    # Cross-check with the real compressed-tensors QuantizationArgs on the overlapping fields.
    ct = pytest.importorskip("compressed_tensors.quantization")
    for name in ("int8_channel", "int4_g128", "int4_g128_asym", "fp8_tensor", "fp8_block128", "int8_token"):
        d = get_preset(name).to_dict()
        args = ct.QuantizationArgs(num_bits=d["num_bits"], type=d["type"], strategy=d["strategy"],
                                   group_size=d["group_size"], block_structure=d["block_structure"],
                                   symmetric=d["symmetric"], dynamic=d["dynamic"])
        assert (args.num_bits, args.type, args.strategy, args.group_size, args.symmetric) == (
            d["num_bits"], d["type"], d["strategy"], d["group_size"], d["symmetric"]), name


def _schemes():
    fmt = st.sampled_from(INT_FORMATS + FLOAT_FORMATS)

    def build(f, strategy, g, b, sym, sf, rule, dyn):
        kind = lb.get_format(f).kind
        kw = dict(format=f, strategy=strategy, dynamic=dyn)
        if strategy == "group":
            kw["group_size"] = g
        if strategy == "block":
            kw["block_size"] = b
        if kind == "int":
            kw["symmetric"] = sym
        elif strategy in ("group", "block") and sf != "fp32":
            kw["scale_format"] = sf
            if sf == "e8m0":
                kw["scale_rounding"] = rule
        return QuantScheme(**kw)

    return st.builds(build, fmt, st.sampled_from(["tensor", "channel", "token", "group", "block"]),
                     st.integers(1, 512), st.tuples(st.integers(1, 256), st.integers(1, 256)), st.booleans(),
                     st.sampled_from(["fp32", "e8m0", "fp8_e4m3fn"]), st.sampled_from(SCALE_ROUNDINGS),
                     st.booleans())


@settings(max_examples=200, deadline=None)
@given(_schemes())
def test_dict_and_json_round_trip(scheme):
    assert QuantScheme.from_dict(scheme.to_dict()) == scheme
    text = scheme.to_json()
    assert json.loads(text) == scheme.to_dict()
    assert QuantScheme.from_json(text) == scheme


def test_from_dict_without_format_and_contradictions():
    s = QuantScheme.from_dict({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                               "symmetric": False, "observer": "minmax", "actorder": None})
    assert s == get_preset("int4_g128_asym")
    s = QuantScheme.from_dict({"num_bits": 8, "type": "float", "strategy": "block", "block_structure": "128x128"})
    assert s == get_preset("fp8_block128")
    with pytest.raises(ValueError, match="num_bits=8 contradicts format 'int4'"):
        QuantScheme.from_dict({"format": "int4", "num_bits": 8, "strategy": "tensor"})
    with pytest.raises(ValueError, match="type='int' contradicts"):
        QuantScheme.from_dict({"format": "fp8_e5m2", "type": "int", "strategy": "tensor"})
    with pytest.raises(ValueError, match="unknown keys \\['groupsize'\\]"):
        QuantScheme.from_dict({"format": "int8", "strategy": "group", "groupsize": 32})
    with pytest.raises(ValueError, match="does not name one format"):
        QuantScheme.from_dict({"num_bits": 6, "type": "float", "strategy": "tensor"})
    with pytest.raises(ValueError, match="missing 'strategy'"):
        QuantScheme.from_dict({"format": "int8"})
    with pytest.raises(ValueError, match="not valid JSON"):
        QuantScheme.from_json("{format: int8")
