"""QTensor files: round trips for every preset, packing and scale layout; validation of
metadata and tensors (missing, extra, inconsistent, unexpected scheme); atomic writes."""
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

import lowbit as lb
from lowbit.io.qtensor_file import QTensorFileError, load_qtensors, save_qtensors
from lowbit.scheme import PRESETS, QuantScheme


def _same(a, b):
    assert a.scheme == b.scheme and tuple(a.shape) == tuple(b.shape)
    assert torch.equal(a.codes, b.codes) and a.codes.dtype == b.codes.dtype
    assert torch.equal(a.scale, b.scale)
    for fld in ("zero_point", "scale_codes", "global_scale"):
        x, y = getattr(a, fld), getattr(b, fld)
        assert (x is None) == (y is None), fld
        if x is not None:
            assert torch.equal(x, y), fld
    assert torch.equal(a.dequantize(), b.dequantize())


@pytest.mark.parametrize("layout", ["row_major", "group_major", "blocked"])
def test_round_trip_every_preset(rng, tmp_path, layout):
    x = torch.randn(9, 200, generator=rng) * 3
    qts = {name: lb.quantize(x, s, pad=True) for name, s in PRESETS.items()}
    path = tmp_path / "q.safetensors"
    save_qtensors(path, qts, scale_layout=layout)
    back = load_qtensors(path)
    assert set(back) == set(qts)
    for name in qts:
        _same(qts[name], back[name])
    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["lowbit.tensors"])
        assert f.metadata()["lowbit.version"] == lb.__version__
        assert meta["mxfp8"]["scheme"]["group_size"] == 32 and meta["mxfp8"]["scale_layout"] == layout
        assert meta["mxfp8"]["scheme"]["scale_rounding"] == "floor" and meta["int4_g128"]["shape"] == [9, 200]
        # 4-bit codes are stored two per byte, fp6 four per three bytes
        assert f.get_slice("int4_g128.codes").get_shape() == [9, 128]
        assert f.get_slice("mxfp6_e2m3.codes").get_shape() == [9, 168]  # K padded 200 -> 224
        if layout == "group_major":
            assert f.get_slice("mxfp8.scale_codes").get_dtype() == "U32"


@settings(max_examples=15, deadline=None)
@given(st.sampled_from(["int4", "uint4", "fp4_e2m1fn", "fp6_e3m2fn", "int2", "fp8_e5m2"]),
       st.integers(1, 3), st.integers(1, 13), st.booleans(), st.integers(0, 2**31 - 1))
def test_round_trip_odd_shapes(tmp_path_factory, fmt, rows, k, pack, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    kind = lb.get_format(fmt)
    scheme = QuantScheme(fmt, "channel", symmetric=kind.kind == "float" or kind.signed)
    qt = lb.quantize(x, scheme)
    path = tmp_path_factory.mktemp("q") / "x.safetensors"
    save_qtensors(path, {"t": qt}, pack=pack)
    _same(qt, load_qtensors(path)["t"])


def test_expect_refuses_other_granularity(rng, tmp_path):
    x = torch.randn(4, 256, generator=rng)
    path = tmp_path / "w.safetensors"
    g32 = QuantScheme("int4", "group", group_size=32)
    save_qtensors(path, {"w": lb.quantize(x, g32), "b": lb.quantize(x, lb.get_preset("mxfp8"))})
    with pytest.raises(QTensorFileError, match=r"'w' was written as int4 group32 .*group_size=32 \(expected 128\).*computes wrong results"):
        load_qtensors(path, expect={"w": lb.get_preset("int4_g128")})
    with pytest.raises(QTensorFileError, match="scale_rounding='floor' \\(expected 'rceil'\\)"):
        load_qtensors(path, expect={"b": QuantScheme("fp8_e4m3fn", "group", group_size=32, scale_format="e8m0",
                                                     scale_rounding="rceil")})
    with pytest.raises(QTensorFileError, match="expected tensors \\['v'\\] are not in the file"):
        load_qtensors(path, expect={"v": g32})
    with pytest.raises(QTensorFileError, match="'b' was written as"):
        load_qtensors(path, expect=g32)  # one scheme for all: b differs
    assert set(load_qtensors(path, expect={"w": g32})) == {"w", "b"}


def _rewrite(src, dst, *, tensors=None, meta=None):
    with safe_open(str(src), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
        m = dict(f.metadata())
    if tensors:
        tensors(t)
    if meta:
        meta(m)
    save_file(t, str(dst), metadata=m)


def _entries_edit(fn):
    def edit(m):
        e = json.loads(m["lowbit.tensors"])
        fn(e)
        m["lowbit.tensors"] = json.dumps(e)
    return edit


@pytest.mark.parametrize("tensors, meta, match", [
    (lambda t: t.pop("w.scale"), None, "missing \\['w.scale'\\]"),
    (lambda t: t.__setitem__("w.extra", torch.zeros(1)), None, "unexpected \\['w.extra'\\]"),
    (lambda t: t.__setitem__("w.scale", torch.ones(4, 4)), None, "scale is torch.float32 \\(4, 4\\), expected"),
    (lambda t: t.__setitem__("w.codes", t["w.codes"].to(torch.int16)), None, "codes is torch.int16"),
    (lambda t: t.__setitem__("w.codes", torch.full_like(t["w.codes"], -128)), None, "outside \\[-127, 127\\]"),
    (None, lambda m: m.pop("lowbit.version"), "missing \\['lowbit.version'\\]"),
    (None, lambda m: m.__setitem__("note", "x"), "unexpected \\['note'\\]"),
    (None, lambda m: m.__setitem__("lowbit.file_version", "9"), "file version '9'"),
    (None, lambda m: m.__setitem__("lowbit.tensors", "{oops"), "not valid JSON"),
    (None, _entries_edit(lambda e: e["w"].pop("codes_packing")), "metadata entry must have keys"),
    (None, _entries_edit(lambda e: e["w"]["scheme"].__setitem__("group_size", 7)), "only applies to strategy='group'"),
    (None, _entries_edit(lambda e: e["w"].__setitem__("shape", [4, 65])), "codes_shape \\[4, 64\\] is inconsistent"),
    (None, _entries_edit(lambda e: e["w"].__setitem__("scale_layout", "blocked")), "scale_layout 'blocked' does not fit"),
    (None, _entries_edit(lambda e: e.pop("w")), "unexpected \\['w.codes', 'w.scale'\\]"),
])
def test_bad_files_fail_cleanly(rng, tmp_path, tensors, meta, match):
    good = tmp_path / "good.safetensors"
    save_qtensors(good, {"w": lb.quantize(torch.randn(4, 64, generator=rng), lb.get_preset("int8_channel")),
                         "m": lb.quantize(torch.randn(4, 64, generator=rng), lb.get_preset("nvfp4"))})
    bad = tmp_path / "bad.safetensors"
    _rewrite(good, bad, tensors=tensors, meta=meta)
    with pytest.raises(QTensorFileError, match=match):
        load_qtensors(bad)


def test_not_a_qtensor_file_and_missing(tmp_path):
    p = tmp_path / "plain.safetensors"
    save_file({"w": torch.zeros(2)}, str(p))
    with pytest.raises(QTensorFileError, match="not a lowbit QTensor file"):
        load_qtensors(p)
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 5)
    with pytest.raises(QTensorFileError, match="too short to be a safetensors file"):
        load_qtensors(tmp_path / "junk.safetensors")
    with pytest.raises(FileNotFoundError):
        load_qtensors(tmp_path / "nope.safetensors")


def test_save_errors_leave_no_file(rng, tmp_path):
    p = tmp_path / "x.safetensors"
    with pytest.raises(TypeError, match="not a QTensor"):
        save_qtensors(p, {"w": torch.zeros(3)})
    with pytest.raises(ValueError, match="non-empty dict"):
        save_qtensors(p, {})
    with pytest.raises(ValueError, match="scale_layout must be one of"):
        save_qtensors(p, {"w": lb.quantize(torch.randn(2, 32, generator=rng), lb.get_preset("mxfp8"))},
                      scale_layout="swizzled")
    assert list(tmp_path.iterdir()) == []


def test_overwrite_is_atomic_and_device(rng, tmp_path, device):
    p = tmp_path / "x.safetensors"
    a = lb.quantize(torch.randn(3, 64, generator=rng).to(device), lb.get_preset("mxfp4"))
    save_qtensors(p, {"a": a})
    save_qtensors(p, {"a": a, "b": a})
    assert sorted(x.name for x in tmp_path.iterdir()) == ["x.safetensors"]  # no temp file left
    back = load_qtensors(p, device=device)
    assert set(back) == {"a", "b"} and back["a"].codes.device.type == torch.device(device).type
    _same(back["b"].to("cpu"), a.to("cpu"))
