"""`lowbit audit --attention`: attention kernels x adversarial cases, verdicts from check_attention."""
import json

import torch

from lowbit.entrypoints.main import main
from lowbit.ops import attention_reference as ar
from lowbit.verify import audit_attention as aa

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _seed(rng) -> int:
    return int(torch.randint(2 ** 31, (1,), generator=rng))      # fresh inputs every run


def _rows(names):
    return [k for k in aa.discover(triton_ok=True) if k.name in names]


def test_torch_rows_conform_and_bf16_sdpa_is_numerical(rng):
    names = ("lowbit attention reference (float64)", "lowbit attention torch, fp8 KV per head",
             "lowbit attention torch, int8 KV per token", "torch SDPA fp32", "torch SDPA bf16 (unquantized baseline)")
    cells = aa.audit(_rows(names), device="cpu", seed=_seed(rng))
    assert len(cells) == len(names) * len(aa.CASES)
    for c in cells:
        if "bf16" in c.kernel:
            # SDPA in bf16 rounds scores / P to bf16: beyond the fp32 gate it is held to, never a
            # logic error (an O-accumulator simulation may claim the cell first: also numerical)
            assert c.verdict == "numerical", c
            assert c.cause in ("computed_in_bf16", "o_accumulated_bf16", "o_accumulated_fp16"), c
            assert c.expected, c            # its documented rounding: not a failure of the audit
        else:
            assert c.verdict == "pass" and not c.expected, c
    assert sum(c.cause == "computed_in_bf16" for c in cells) >= len(aa.CASES) // 2


def test_triton_rows_conform(rng):
    # compiled on a GPU, in Triton's CPU interpreter elsewhere (two small cases keep CI short)
    rows = _rows(("lowbit triton attention, fp8 KV per head", "lowbit triton attention, int8 KV per token"))
    cases = [c for c in aa.CASES if c.name in ("decode, GQA 3", "all-zero KV head")]
    cells = aa.audit(rows, cases, device=DEV, seed=_seed(rng))
    assert [c.verdict for c in cells] == ["pass"] * 4, cells


def _sdpa_top_left(q, k, v, spec):
    """A real-world bug: SDPA's is_causal aligns the mask top-left, so a decode query behind a
    cache sees only the first key(s) instead of all of them."""
    G = q.shape[1] // k.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), is_causal=spec.causal)


def test_wrong_mask_is_logic_even_in_bf16(rng):
    plain = ar.AttnSpec(q_format=None, p_format=None, p_block=aa.P_BLOCK)
    case = [c for c in aa.CASES if c.name == "decode, GQA 3"]
    for dtype in (torch.float32, torch.bfloat16):
        kern = aa.AttnKernel(f"sdpa is_causal {dtype}", None, plain, _sdpa_top_left, dtype=dtype, out_dtype=dtype)
        cell = aa.audit([kern], case, device="cpu", seed=_seed(rng))[0]
        # the bf16 bound does not hide it: the output is the first key's V, far outside any rounding
        assert cell.verdict == "logic" and cell.cause == "unexplained", cell
        assert not cell.expected, cell


def test_cli_attention_table(tmp_path, rng, capsys):
    js = tmp_path / "a.json"
    rc = main(["audit", "--attention", "--seed", str(_seed(rng)), "--only", "SDPA fp32",
               "--case", "decode, GQA 3", "--case", "one dominant key", "--json", str(js)])
    assert rc == 0
    data = json.loads(js.read_text())
    assert [c["verdict"] for c in data["cells"]] == ["pass", "pass"]
    assert data["kernels"][0]["kv_scheme"] == "unquantized"
    assert "torch SDPA fp32" in capsys.readouterr().out
    assert main(["audit", "--attention", "--kernel", "m:f"]) == 2
    assert "--attention" in capsys.readouterr().err


def test_cli_exit_status_keeps_the_bf16_baseline_expected(rng, capsys):
    """The bf16 SDPA baseline's numerical cells are its documented rounding: exit 0, marked in the
    listing; a kernel whose numerical verdict is not documented fails the exit status."""
    rc = main(["audit", "--attention", "--seed", str(_seed(rng)), "--only", "SDPA bf16",
               "--case", "decode, GQA 3", "--case", "scores growing along keys"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "numerical (expected of this row)" in out, out
    kern = [k for k in aa.discover(triton_ok=False) if "bf16" in k.name][0]
    undocumented = aa.AttnKernel("bf16 SDPA, not declared", kern.kv_scheme, kern.spec, kern.fn, dtype=kern.dtype,
                                 out_dtype=kern.out_dtype)
    cells = aa.audit([undocumented], [c for c in aa.CASES if c.name == "decode, GQA 3"], seed=_seed(rng))
    assert cells[0].verdict == "numerical" and not cells[0].expected, cells
