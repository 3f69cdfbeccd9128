"""Streaming safetensors I/O and tensor-by-tensor checkpoint quantization.

Oracles: the safetensors library reads what lowbit writes and writes what lowbit reads;
the streamed quantization equals the in-memory one (quantize_model + save_compressed)
tensor for tensor; peak memory is measured in a child process.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lowbit.pipelines.checkpoint import load_compressed, save_compressed
from lowbit.pipelines.tensorwise import quantize_checkpoint
from lowbit.io.st_format import CheckpointError, ShardedWriter, TensorReader, checkpoint_files, read_header


def _bits(t):
    # compare float8 and friends by their bytes
    return t.contiguous().view(torch.uint8) if t.dtype.itemsize == 1 and t.is_floating_point() else t


def random_tensors(rng):
    return {
        "a.weight": torch.randn(37, 53, generator=rng),
        "b.codes": torch.randint(-128, 128, (7, 3), generator=rng, dtype=torch.int8),
        "c.fp8": torch.randn(29, generator=rng).to(torch.float8_e4m3fn),
        "d.scalar": torch.randn((), generator=rng),
        "e.bf16": torch.randn(3, 5, generator=rng).bfloat16(),
        "f.empty": torch.zeros(0, 4),
        "g.packed": torch.randint(-2**31, 2**31 - 1, (4, 9), generator=rng, dtype=torch.int32),
        "h.u8": torch.randint(0, 256, (11,), generator=rng, dtype=torch.uint8),
    }


# header_reserve: 0 (compact headers), 64 (too small for these headers: the copy fallback),
# 16 KiB (every header written in place, padded with spaces)
@pytest.mark.parametrize("reserve", [0, 64, 1 << 14])
def test_writer_output_read_by_safetensors(rng, tmp_path, reserve):
    ts = random_tensors(rng)
    # one tensor copied file to file (add_from_file), from a safetensors library file
    src = tmp_path / "src.safetensors"
    save_file({"pad": torch.randn(3, generator=rng), "z.copied": torch.randn(41, 7, generator=rng)}, src)
    out = tmp_path / "out"
    out.mkdir()
    w = ShardedWriter(out, max_shard_bytes=4096, header_reserve=reserve)
    for k, v in ts.items():
        w.add(k, v)
    with TensorReader(src) as r:
        ts["z.copied"] = r.get("z.copied")
        w.add_from_file("z.copied", torch.float32, [41, 7], src, r.span("z.copied")[0])
    ts["z.after"] = torch.randn(5, generator=rng)      # a buffered write after the kernel's copy
    w.add("z.after", ts["z.after"])
    names = w.finish()
    assert len(names) > 1 and names[0] == f"model-00001-of-{len(names):05d}.safetensors"
    assert not [f for f in os.listdir(out) if f.startswith(".")]  # data files cleaned up
    sizes = [int.from_bytes((out / n).read_bytes()[:8], "little") for n in names]
    if reserve == 1 << 14:
        assert sizes == [reserve] * len(names)          # in place
    elif reserve == 64:
        assert all(n > 64 for n in sizes)               # none fitted: copied behind a compact header
    tmp_path = out
    where = checkpoint_files(tmp_path)
    assert set(where) == set(ts)
    for k, v in ts.items():
        with safe_open(where[k], framework="pt") as f:
            got = f.get_tensor(k)
            assert f.metadata()["format"] == "pt"
        assert got.dtype == v.dtype and got.shape == v.shape and torch.equal(_bits(got), _bits(v)), k


def test_reader_reads_safetensors_files(rng, tmp_path):
    ts = random_tensors(rng)
    save_file(ts, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with TensorReader(tmp_path / "model.safetensors") as r:
        assert set(r.keys()) == set(ts) and r.metadata == {"format": "pt"}
        for k, v in ts.items():
            got = r.get(k)
            assert got.dtype == v.dtype and got.shape == v.shape and torch.equal(_bits(got), _bits(v)), k


def test_reader_rejects_truncated_and_garbage(rng, tmp_path):
    save_file({"x": torch.randn(64, 64, generator=rng)}, tmp_path / "m.safetensors")
    data = (tmp_path / "m.safetensors").read_bytes()
    for cut, msg in [(len(data) - 1, "truncated"), (20, "truncated"), (5, "too short")]:
        (tmp_path / "m.safetensors").write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match=msg):
            read_header(tmp_path / "m.safetensors")
    (tmp_path / "m.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(CheckpointError, match="JSON"):
        read_header(tmp_path / "m.safetensors")
    (tmp_path / "other.safetensors").write_bytes(data)
    with pytest.raises(CheckpointError, match="no model.safetensors.index.json"):
        checkpoint_files(tmp_path)


# ------------------------------------------------------------------ quantize_checkpoint
def tiny_llama_dir(rng, path, shard="120KB"):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    model.save_pretrained(path, max_shard_size=shard)
    (path / "tokenizer_config.json").write_text("{}")  # stands for the files that are copied
    return model


@pytest.mark.parametrize("recipe", ["w8a8-int8", "w4a16-asym", "nvfp4"])
def test_streamed_equals_in_memory(recipe, rng, tmp_path):
    from lowbit.pipelines.quantize_model import quantize_model
    model = tiny_llama_dir(rng, tmp_path / "in")
    assert len([f for f in os.listdir(tmp_path / "in") if f.endswith(".safetensors")]) > 1
    summary = quantize_checkpoint(tmp_path / "in", tmp_path / "out", recipe, max_shard_bytes=100_000)
    assert "lm_head" in summary["kept"] and len(summary["quantized"]) == 14
    assert (tmp_path / "out" / "tokenizer_config.json").exists()
    quantize_model(model, recipe)
    save_compressed(model, tmp_path / "ref", recipe)
    streamed, ref = checkpoint_files(tmp_path / "out"), checkpoint_files(tmp_path / "ref")
    assert set(streamed) == set(ref)
    for name in ref:
        with TensorReader(streamed[name]) as a, TensorReader(ref[name]) as b:
            x, y = a.get(name), b.get(name)
            assert x.dtype == y.dtype and torch.equal(_bits(x), _bits(y)), name
    qa = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    qb = json.loads((tmp_path / "ref" / "config.json").read_text())["quantization_config"]
    assert qa == qb
    ck = load_compressed(tmp_path / "out")
    assert set(ck.qtensors) == set(summary["quantized"])


def test_bad_inputs_write_nothing(rng, tmp_path):
    tiny_llama_dir(rng, tmp_path / "in")
    with pytest.raises(ValueError, match="matches no Linear"):
        quantize_checkpoint(tmp_path / "in", tmp_path / "out", "w8a8-int8", ignore=["model.layers.*.nothing"])
    with pytest.raises(ValueError, match="not a lowbit recipe"):
        quantize_checkpoint(tmp_path / "in", tmp_path / "out", "w3a3")
    # NaN in the last weight read: the error comes mid-stream and must leave no output behind
    where = checkpoint_files(tmp_path / "in")
    victim = "model.layers.1.mlp.down_proj.weight"
    with TensorReader(where[victim]) as r:
        tensors = {k: r.get(k) for k in r.keys()}
    tensors[victim][3, 5] = float("nan")
    save_file(tensors, where[victim], metadata={"format": "pt"})
    with pytest.raises(ValueError, match="NaN"):
        quantize_checkpoint(tmp_path / "in", tmp_path / "out", "w8a8-int8")
    assert sorted(os.listdir(tmp_path)) == ["in"]
    # an input shard cut short is found before anything is written
    data = open(where[victim], "rb").read()
    open(where[victim], "wb").write(data[:-10])
    with pytest.raises(CheckpointError, match="truncated"):
        quantize_checkpoint(tmp_path / "in", tmp_path / "out", "w8a8-int8")
    assert sorted(os.listdir(tmp_path)) == ["in"]


def test_no_config_needs_targets(rng, tmp_path):
    (tmp_path / "in").mkdir()
    save_file({"l.proj.weight": torch.randn(8, 64, generator=rng)}, tmp_path / "in" / "model.safetensors")
    with pytest.raises(ValueError, match="targets"):
        quantize_checkpoint(tmp_path / "in", tmp_path / "out", "w8a16-int8")
    s = quantize_checkpoint(tmp_path / "in", tmp_path / "out", "w8a16-int8", targets=["*.proj"])
    assert s["quantized"] == ["l.proj"]
    assert load_compressed(tmp_path / "out").qtensors["l.proj"].codes.shape == (8, 64)


# The child measures its own peak resident set: VmHWM after resetting it (clear_refs 5)
# once imports and one warm-up quantization are done, so the baseline is lowbit's steady
# working set and the measured growth is what streaming the checkpoint costs.
CHILD = r"""
import json, sys, torch
from lowbit.pipelines.tensorwise import quantize_checkpoint
from lowbit.io import ct_layout
from lowbit.recipes.presets import get_recipe
from lowbit.quantize import quantize
rec = get_recipe(sys.argv[3])
ct_layout.qtensor_to_ct(quantize(torch.randn(64, 1024), rec.weight), ct_layout.ct_format(rec.weight, rec.act))
def kb(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
open("/proc/self/clear_refs", "w").write("5")
base = kb("VmRSS")
s = quantize_checkpoint(sys.argv[1], sys.argv[2], sys.argv[3], targets=["re:.*proj.*"], max_shard_bytes=16 << 20)
print(json.dumps({"base": base * 1024, "peak": kb("VmHWM") * 1024, "shards": len(s["shards"]),
                  "bytes_in": s["bytes_in"], "n": len(s["quantized"])}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc to measure peak RSS")
@pytest.mark.parametrize("recipe", ["w4a16"])
def test_peak_memory_is_bounded_by_largest_tensor(recipe, rng, tmp_path):
    # 8 shards x 12 weights of 512 x 1024 float32 (2 MiB each): 192 MiB of checkpoint.
    rows, cols, per, shards = 512, 1024, 12, 8
    largest = rows * cols * 4
    src = tmp_path / "in"
    src.mkdir()
    weight_map = {}
    for i in range(shards):
        ts = {f"layers.{i}.proj{j}.weight": torch.randn(rows, cols, generator=rng) for j in range(per)}
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file(ts, src / fname, metadata={"format": "pt"})
        weight_map.update({k: fname for k in ts})
        del ts
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    # The child's wall time grows several-fold on a loaded machine (its RSS does not), so the
    # limit is generous: it only catches a hung child.
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, str(src), str(tmp_path / "out"), recipe],
                             capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired:
        pytest.fail("the quantizing child ran over 30 min: hung, or the machine is far too loaded "
                    "(this is not a memory measurement)")
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["n"] == shards * per and r["shards"] > 1
    # Bound: the float32 tensor read (1x), quantize's float32 temporaries (|x|, x / s,
    # rounded, clamped: <= 4x), the codes and compressed-tensors' tensors (<= 1x) and the
    # allocator keeping the previous tensor's freed blocks (<= 2x): 8 x largest; plus 32 MiB
    # for Python objects, headers and malloc arenas. The checkpoint is 4x larger than this.
    bound = 8 * largest + (32 << 20)
    assert r["bytes_in"] >= 4 * bound
    grew = r["peak"] - r["base"]
    print(f"peak RSS growth {grew / 2**20:.1f} MiB for {r['bytes_in'] / 2**20:.0f} MiB of checkpoint; "
          f"bound {bound / 2**20:.0f} MiB")
    assert grew <= bound


def test_group_that_does_not_divide_k_is_refused_up_front(rng, tmp_path):
    (tmp_path / "in").mkdir()
    save_file({"a.proj.weight": torch.randn(8, 256, generator=rng), "b.proj.weight": torch.randn(8, 192, generator=rng)},
              tmp_path / "in" / "model.safetensors")
    with pytest.raises(ValueError, match=r"b\.proj \[8, 192\].*ignore"):
        quantize_checkpoint(tmp_path / "in", tmp_path / "out", "w4a16", targets=["*.proj"])
    assert sorted(os.listdir(tmp_path)) == ["in"]
    s = quantize_checkpoint(tmp_path / "in", tmp_path / "out", "w4a16", targets=["*.proj"], ignore=["b.proj"])
    assert s["quantized"] == ["a.proj"] and s["kept"] == ["b.proj"]


def test_two_writers_finish_as_one_checkpoint(rng, tmp_path):
    # two tagged writers fill one directory (as two threads do in lowbit.pipelines.layerwise) and finish
    # as one checkpoint: the first writer's shards, then the second's, one index
    ts = random_tensors(rng)
    a = ShardedWriter(tmp_path, max_shard_bytes=4096, tag="rest")
    b = ShardedWriter(tmp_path, max_shard_bytes=4096, header_reserve=1 << 12)
    for i, (k, v) in enumerate(sorted(ts.items())):
        (a if i % 3 == 0 else b).add(k, v)
    with pytest.raises(ValueError, match="letters and digits"):
        ShardedWriter(tmp_path, tag="a/b")
    names = a.finish(b)
    assert len(names) > 2 and not [f for f in os.listdir(tmp_path) if f.startswith(".")]
    where = checkpoint_files(tmp_path)
    assert set(where) == set(ts)
    assert where[sorted(ts)[0]].endswith(names[0])      # the first writer's shard comes first
    for k, v in ts.items():
        with safe_open(where[k], framework="pt") as f:
            assert torch.equal(_bits(f.get_tensor(k)), _bits(v)), k
    c, d = ShardedWriter(tmp_path / "x", tag="c"), ShardedWriter(tmp_path / "x")
    (tmp_path / "x").mkdir()
    c.add("same", torch.zeros(2))
    d.add("same", torch.ones(2))
    with pytest.raises(ValueError, match="written by two writers"):
        c.finish(d)
