"""The attention kernels as classes (lowbit.ops.kernels.attention): each class's refusals, the
preference order, a caller's and a tuning table's choice, the table's cells as classes (what `lowbit
tune` writes is what dispatch reads back), explain_attention per device, and the extension point (a
class registered from outside runs the calls it takes through attention_triton, and only those)."""
import pytest
import torch

from lowbit.ops import attention as attn
from lowbit.ops import attention_reference as ar
from lowbit.ops import tuning
from lowbit.ops.kernels import ATTENTION, Device, explain_attention
from lowbit.ops.kernels.attention import (AttentionKernel, Flash, Prefill, SdpaDequant, SplitKV, choose,
                                          prefill_options, resolve, table_choice)
from lowbit.ops.kernels.attention_call import AttentionCall, CacheOperand
from lowbit.ops.kv_quant import KVScheme, quantize_kv
from lowbit.ops.triton.attention_prefill import PrefillConfig

SPEC = ar.AttnSpec(p_block=16)


def op(name):
    """A cache operand by --kv-cache name; "bf16" / "fp32": float values."""
    if name == "bf16":
        return CacheOperand.of_scheme(None)
    if name == "fp32":
        return CacheOperand("float", None, torch.float32)
    return CacheOperand.of_scheme(KVScheme.parse(name))


def call(Tq=1, G=4, q="quantized", k="fp8-head", v=None, spec=SPEC, D=64):
    return AttentionCall(Tq, G, D, q, op(k), op(v or k), spec)


# (class, a call it takes, a call it refuses, a phrase of the reason)
CASES = [
    (SplitKV, call(16, 4), call(17, 4), "68 rows per KV head"),
    (SplitKV, call(1, 4, q="bf16", k="bf16"), call(1, 4, q="float", k="bf16"), "Q must be codes"),
    (SplitKV, call(1, 4, k="int8-token"), call(1, 4, k="int4-g32"), "k: a group cache"),
    (SplitKV, call(1, 4, k="fp8-token"), call(1, 4, k="fp32"), "k: a float cache"),
    (Prefill, call(300, 4, k="fp8-token", v="fp8-head"), call(300, 4, k="fp8-token"), "v: scales per token"),
    (Prefill, call(300, 4, q="codes"), call(300, 4, spec=ar.AttnSpec(p_format=None)), "P must be quantized"),
    (Prefill, call(300, 4, k="int8-head"), call(300, 4, k="int4-g32"), "k: int4 codes"),
    (Prefill, call(300, 4, q="bf16", k="bf16"), call(300, 4, q="bf16", k="fp32"), "unquantized torch.float32"),
    (Prefill, call(300, 4, q="bf16", k="bf16"), call(300, 4, q="float", k="bf16"), "Q must be codes"),
    (SdpaDequant, call(300, 4, q="quantized"), call(300, 4, q="codes"), "float queries"),
]


@pytest.mark.parametrize("cls,ok,bad,why", CASES, ids=lambda c: getattr(c, "name", None))
def test_each_class_says_which_calls_it_refuses_and_why(cls, ok, bad, why):
    assert cls.can_run(ok, None) is None
    reason = cls.can_run(bad, None)
    assert reason is not None and why in reason, reason


def test_flash_runs_every_layout():
    for k in ("fp8", "fp8-token", "int8-head", "int4-g32", "bf16", "fp32"):
        for q in ("codes", "quantized", "bf16", "float"):
            assert Flash.can_run(call(300, 4, q=q, k=k), None) is None


def test_preference_order_and_devices():
    assert ATTENTION.names() == ["split_kv", "prefill", "flash", "sdpa"]
    assert choose(call(1, 4)).name == "split_kv"
    c = choose(call(300, 4, k="int4-g32"))
    assert c.name == "flash" and [n for n, _ in c.refused] == ["split_kv", "prefill"]
    # SDPA runs only where chosen: a call every Triton class refuses (no Triton here) gets no kernel
    cpu = choose(call(300, 4), Device("cpu"))
    assert cpu.kernel is None and all("triton is not installed" in why for _, why in cpu.refused[:3])
    assert "chooses it" in dict(cpu.refused)["sdpa"]
    assert SdpaDequant.can_run(call(300, 4), Device("cpu")) is None        # torch's SDPA needs no Triton


def test_a_callers_choice_and_a_tables():
    # the choice stands where split-KV does not take the call; the classes it skipped say why
    assert choose(call(1, 4), chosen="sdpa").name == "split_kv"
    c = choose(call(300, 4), chosen="sdpa")
    assert c.name == "sdpa" and dict(c.refused)["prefill"] == "'sdpa' was chosen for this call"
    assert choose(call(300, 4), chosen="flash").name == "flash"
    # a caller's choice it cannot run: refused with the reason and the alternatives
    with pytest.raises(ValueError, match=r"'prefill' cannot run this call: v: scales per token.*'flash' or 'sdpa'"):
        choose(call(300, 4, k="fp8-token"), chosen="prefill")
    with pytest.raises(ValueError, match=r"'sdpa' cannot run this call: .*float queries.*'prefill' or 'flash'"):
        choose(call(300, 4, q="codes"), chosen="sdpa")
    # a table's: passed over, recorded, and the preference order decides
    c = choose(call(300, 4, q="codes"), chosen="sdpa", strict=False)
    assert c.name == "prefill" and "float queries" in dict(c.refused)["sdpa"]
    for name in ("split_kv", "cudnn"):
        with pytest.raises(ValueError, match="must be one of \\['prefill', 'flash', 'sdpa'\\]"):
            choose(call(300, 4), chosen=name)


def _table(c: AttentionCall, path, cfg):
    cell = tuning.Cell("attention", c.kind, c.D, c.G, tuning.bucket(c.Tq), path, cfg)
    tuning.reset(tuning.Table(tuning.environment(), {("attention", c.kind, c.D, c.G, cell.bucket): cell}), "test")


def test_table_cells_name_classes():
    c = call(40, 4)
    cases = [("dequant", None, ("sdpa", None)),
             ("kernel", None, (None, None)),                                     # the kernel's default
             ("kernel", {"kernel": "flash"}, ("flash", None)),
             ("kernel", {"kernel": "prefill", "block_m": 32, "num_warps": 4, "num_stages": 1},
              ("prefill", PrefillConfig(32, 4, 1))),
             ("kernel", {"block_m": 16, "num_warps": 4, "num_stages": 2}, ("prefill", PrefillConfig(16, 4, 2)))]
    try:
        for path, cfg, want in cases:
            _table(c, path, cfg)
            assert table_choice(c) == want
        _table(c, "kernel", {"kernel": "cudnn"})
        with pytest.raises(ValueError, match="got 'cudnn'"):
            table_choice(c)
        # the table's choice runs the call unless split-KV takes it (a decode step is never tuned)
        _table(c, "dequant", None)
        assert resolve(c)[0].name == "sdpa" and resolve(call(1, 4))[0].name == "split_kv"
        assert resolve(c, kernel="flash")[0].name == "flash"             # the caller's choice first
        choice, cfg = resolve(call(40, 4, q="codes"))                    # Q's codes: SDPA passed over
        assert choice.name == "prefill" and isinstance(cfg, PrefillConfig)
    finally:
        tuning.reset()


def test_what_tune_writes_is_what_dispatch_reads():
    """Every (kernel, config) `lowbit tune` times, written as a cell by its class and read back."""
    c = call(300, 4, D=64)
    opts = prefill_options(64, 300, 16)
    assert [k for k, _ in opts][-2:] == ["flash", "sdpa"] and {k for k, _ in opts[:-2]} == {"prefill"}
    try:
        for name, cfg in opts:
            path, config = ATTENTION.get(name).cell(cfg)
            _table(c, path, config)
            assert table_choice(c) == (name, cfg)
    finally:
        tuning.reset()


def test_the_shipped_table_loads_and_its_attention_cells_name_classes():
    t = tuning.load_table(tuning.TABLES_DIR / "nvidia-h200.json")
    for cell in (x for x in t.cells.values() if x.op == "attention"):
        if cell.config is not None:
            assert ATTENTION.get(cell.config.get("kernel", "prefill")).choosable
        else:
            assert cell.path == "kernel" or any(k.table_path == cell.path for k in ATTENTION)


def test_explain_attention_per_device():
    rep = explain_attention(KVScheme.parse("int4-g32"), device=Device("interpreter"))
    assert rep["calls"]["decode"]["kernel"] == "flash" and rep["calls"]["prefill"]["kernel"] == "flash"
    assert "k: int4 codes" in dict(rep["calls"]["decode"]["refused"])["prefill"]
    rep = explain_attention(KVScheme.parse("fp8-head"), device=Device("interpreter"))
    assert [rep["calls"][c]["kernel"] for c in ("decode", "prefill")] == ["split_kv", "prefill"]
    assert explain_attention(None, device=Device("cpu"))["calls"]["decode"]["kernel"] is None


class FakeGroupKernel(AttentionKernel):
    """Takes only head-dim-group caches; returns ones (not attention: the test sees which ran)."""
    name = "fake_group"
    calls = 0

    @classmethod
    def refuses(cls, call):
        return None if call.k.kind == "group" else "group caches only"

    @classmethod
    def apply(cls, q, k, v, spec, *, q_scale, out_dtype, config):
        cls.calls += 1
        return torch.ones(q.shape, dtype=out_dtype)


def test_a_registered_class_runs_the_calls_it_takes(rng, interpreter):
    D = 32
    q = torch.randn(1, 2, 3, D, generator=rng)
    kv = torch.randn(1, 1, 20, D, generator=rng)
    kg = quantize_kv(kv, KVScheme.parse("int4-g16"))
    with ATTENTION.registered(FakeGroupKernel, before="split_kv"):
        out = attn.attention_triton(q, kg, kg, SPEC)
        assert attn.last_path() == "fake_group" and FakeGroupKernel.calls == 1 and torch.equal(out, torch.ones_like(q))
        kb = kv.to(torch.bfloat16)
        attn.attention_triton(q, kb, kb, SPEC)
        assert attn.last_path() == "split_kv" and FakeGroupKernel.calls == 1
    assert "fake_group" not in ATTENTION.names()
    attn.attention_triton(q, kg, kg, SPEC)
    assert attn.last_path() == "flash" and FakeGroupKernel.calls == 1
