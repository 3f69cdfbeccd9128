"""`lowbit bench model`'s `+native` variants on the CPU: the parser (either suffix order; recipes no native
class covers refused with the ones it covers), a variant whose native library cannot run here as n/a rows
that say why (never timed under its name), the kernel classes each variant's layers took, and the opt-in
scoped to that variant's build (lowbit.ops.kernels.native.opted_in). There is no sm_90 GPU here: where a
test needs the native classes chosen, it stands an H200 in for the kernel device and a library that can run
in for lowbit.ops.native.library; the model stays on the CPU, so its calls run the exact path."""
import json
import threading

import pytest
import torch

pytest.importorskip("transformers")

import lowbit as lb  # noqa: E402
from lowbit.bench import llama  # noqa: E402
from lowbit.bench import model as bm  # noqa: E402
from lowbit.bench.model_variants import check_variants, parse_variant  # noqa: E402
from lowbit.entrypoints.main import main  # noqa: E402
from lowbit.nn import QuantLinear  # noqa: E402
from lowbit.ops.kernels import dense  # noqa: E402
from lowbit.ops.kernels import native as kn  # noqa: E402
from lowbit.ops.kernels.base import Device  # noqa: E402
from lowbit.ops.native import library  # noqa: E402

# recipes whose schemes the native classes take, by their documented conditions (ops/kernels/native.py):
# int4 in groups of 32-256, int8 per channel weight-only, int8 / e4m3 per channel x per-token activations
COVERED = ["w8a8-int8", "w8a8-fp8", "w8a16-int8", "w4a16", "w4a16-asym", "w4a16-g32"]
H200 = Device("cuda", (9, 0))
OPT_OUT = "opt-in: set LOWBIT_NATIVE=1"


def _opts(**kw) -> bm.Options:
    # w4a16-g32 at the tiny shape: K = 64 takes the int4 kernels, down_proj's K = 176 (padded) does not
    return bm.Options(shape="tiny", layers=1, dtype="fp32", device="cpu", modes=("eager",), prefill=11, context=7,
                      batches=(1, 3), error_tokens=9, budget=3600.0, quick=True, log=lambda m: None, **kw)


def _by_variant(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r["variant"], []).append(r)
    return out


@pytest.fixture
def gpu_stand_in(monkeypatch):
    """The native classes can be chosen here: an H200 as the kernel device, a library that can run (and is
    never loaded: the model's calls run the exact path on the CPU), no environment opt-in."""
    monkeypatch.delenv(kn.OPT_IN, raising=False)
    monkeypatch.setattr(library, "unavailable_reason", lambda: None)
    monkeypatch.setattr(library, "load", lambda: None)
    monkeypatch.setattr(dense, "kernel_device", lambda: H200)


def test_parser_takes_both_suffixes_in_either_order():
    a, b = parse_variant("W4A16+native+lm_head=int8"), parse_variant("w4a16+lm_head=int8+native")
    assert (a.recipe, a.lm_head, a.native) == (b.recipe, b.lm_head, b.native) == ("w4a16", "int8", True)
    assert (parse_variant("w4a16").native, parse_variant("w4a16").lm_head) == (False, None)
    names = [f"{r}+native" for r in COVERED] + ["w8a8-fp8+lm_head=fp8+native"]
    assert [v.name for v in check_variants(tuple(names))] == names


@pytest.mark.parametrize("names,says", [
    ("mxfp8+native", "no native decode kernel"), ("nvfp4+native,mxfp4+native", "no native decode kernel"),
    ("w8a8-int8-tensor+native", "no native decode kernel"), ("w4a16+nativ", "'nativ' is not a suffix"),
    ("w4a16+native+native", "given twice"), ("w4a16+lm_head=int8+lm_head=fp8", "given twice"),
    ("torchao-int4+native", "not known"), ("w4a16+lm_head=int4+native", "not known")])
def test_parser_refuses_with_the_fix(names, says, capsys):
    assert main(["bench", "model", "--device", "cpu", "--shape", "tiny", "--recipes", names]) == 2
    err = capsys.readouterr().err
    assert f"recipes={names}" in err and says in err, err
    if says == "no native decode kernel":   # the message lists every recipe +native takes
        assert all(r in err for r in COVERED) and "+native works with" in err


def test_without_the_library_the_native_variant_is_n_a_and_the_opt_in_does_not_leak(tmp_path, monkeypatch):
    """The CLI on this machine (no sm_90 GPU, a model on the CPU): the +native rows are not timed and say why;
    the plain variant in the same process runs its Triton classes; afterwards the opt-in is off again."""
    monkeypatch.delenv(kn.OPT_IN, raising=False)
    out = tmp_path / "bench.json"
    rc = main(["bench", "model", "--device", "cpu", "--shape", "tiny", "--layers", "1", "--dtype", "fp32",
               "--recipes", "w4a16-g32+native,w4a16-g32", "--no-compile", "--quick", "--prefill", "11",
               "--context", "7", "--batches", "1,3", "--error-tokens", "9", "--budget", "3600", "--json", str(out)])
    assert rc == 0
    run = json.loads(out.read_text())
    by = _by_variant(run["rows"])
    lib = library.unavailable_reason()
    why = f"n/a: {lib}" if lib else "n/a: the native kernels run on a CUDA GPU; this run's model is on cpu"
    assert len(by["w4a16-g32+native"]) == 3
    assert all(r["ms"] is None and r["skipped"] == why and "kernels" not in r for r in by["w4a16-g32+native"])
    assert all(r["ms"] > 0 and r["kernels"] == {"triton_w4a16": 6, "exact_dequantized": 1} for r in by["w4a16-g32"])
    assert run["environment"]["native_library"]["unavailable_reason"] == lib
    assert kn.native_refusal().startswith(OPT_OUT)


def test_an_opted_in_build_reports_its_native_classes_and_stays_scoped(gpu_stand_in, monkeypatch):
    """With the native classes choosable, the +native variant's layers take them, the plain variant built after
    it in the same run takes the Triton classes (and so does one built with LOWBIT_NATIVE=1 set: a variant's
    name decides), and the native layer holds its weight once."""
    monkeypatch.setattr(bm, "native_unavailable", lambda device: None)   # the model is on the CPU
    rows = bm.run_bench(_opts(variants=("w4a16-g32+native", "w4a16-g32")))
    by = _by_variant(rows)
    assert all(r["kernels"] == {"native_w4a16": 6, "exact_dequantized": 1} and r["ms"] > 0
               for r in by["w4a16-g32+native"])
    assert all(r["kernels"] == {"triton_w4a16": 6, "exact_dequantized": 1} for r in by["w4a16-g32"])
    # a weight-only native layer holds its codes once (no Triton layout beside the native one): the two variants'
    # weights differ by padding and counters, far less than half the 6 int4 layers' K * N / 2 code bytes
    model = llama.build_llama("tiny", 1, torch.float32, "cpu", 0)
    int4 = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "down_proj" not in n
            and n != "lm_head"]
    extra = by["w4a16-g32+native"][0]["weight_bytes"] - by["w4a16-g32"][0]["weight_bytes"]
    assert len(int4) == 6 and abs(extra) < sum(m.in_features * m.out_features // 2 for m in int4) // 2, extra
    assert kn.native_refusal().startswith(OPT_OUT)

    monkeypatch.setenv(kn.OPT_IN, "1")
    rows = bm.run_bench(_opts(variants=("w4a16-g32",)))
    assert all(r["kernels"] == {"triton_w4a16": 6, "exact_dequantized": 1} for r in rows if r["kind"] == "lowbit")
    assert kn.native_refusal() is None          # the environment's opt-in holds again after the run


def test_a_native_variant_whose_layers_all_refuse_is_n_a_with_the_reason(gpu_stand_in, monkeypatch):
    monkeypatch.setattr(bm, "native_unavailable", lambda device: None)
    monkeypatch.setattr(dense, "kernel_device", lambda: Device("cuda", (10, 0)))   # no sm_90a code for it
    rows = bm.run_bench(_opts(variants=("w8a16-int8+native",)))
    skipped = [r["skipped"] for r in rows if r["kind"] == "lowbit"]
    assert len(skipped) == 3 and len(set(skipped)) == 1
    assert skipped[0].startswith("n/a: no layer took a native kernel (native_w8a16: ") and "sm_90a" in skipped[0]


def test_opted_in_is_scoped_to_its_block_context_and_the_layers_prepared_inside(gpu_stand_in, rng):
    w = lb.quantize(torch.randn(37, 128, generator=rng), lb.get_preset("int8_channel"))
    assert kn.native_refusal().startswith(OPT_OUT)
    seen = {}
    with kn.opted_in():
        assert kn.native_refusal() is None
        inside = QuantLinear(w, w.scheme, None)
        worker = threading.Thread(target=lambda: seen.update(other=kn.native_refusal()))
        worker.start()
        worker.join()
        with kn.opted_in(False):
            assert kn.native_refusal().startswith("opt-in: opted out")
            assert dense.choose_linear(w, None).name == "triton_w8a16"
        assert dense.choose_linear(w, None).name == "native_w8a16"
    with pytest.raises(KeyError), kn.opted_in():
        raise KeyError("the block raised")
    assert kn.native_refusal().startswith(OPT_OUT) and seen["other"].startswith(OPT_OUT)
    # dispatch asks once, when a layer is prepared: the layer keeps its native class after the block
    assert inside.kernel_choice.name == inside.fast_spec.kernel == "native_w8a16"
    assert QuantLinear(w, w.scheme, None).kernel_choice.name == "triton_w8a16"
