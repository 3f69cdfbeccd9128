"""QuantExperts on six transformers 5 MoE families: the family's own forward is the oracle.

Each grouped GEMM is compared with the float GEMM within lowbit.verify.tolerance's
quantization_bounds; whole-module comparisons use an element-wise bound propagated through the
experts' arithmetic (`_bound` below): h = x W1^T, a = glu(h), y = a W2^T, out = sum_j r_j y_j, with
  |dh| <= ex |W1|^T + (|x| + ex) eW1^T + gamma_H (|x| + ex)(|W1| + eW1)^T
  |da| <= L |dg| (|u| + |du|) + |act(g)| |du| + ea      (L = max |silu'| = 1.0998; gpt-oss's
          g * sigmoid(alpha g) has derivative silu'(alpha g), and its clamps are 1-Lipschitz)
  |dy| <= da |W2|^T + (|a| + da) eW2^T + gamma_I (|a| + da)(|W2| + eW2)^T
  |dout| <= sum_j |r_j| |dy_j|
where ex / eW / ea are per-element bounds of what differs between the two sides (a rounding
unit, a quantization step) and gamma_n = n u / (1 - n u) covers the accumulation order."""
import copy

import pytest
import torch

from lowbit.archs.experts import find_experts, router_of
from lowbit.nn.experts import QuantExperts
from lowbit.ops.grouped import sort_tokens, take_rows
from lowbit.quantize import quantize
from lowbit.recipes.presets import get_recipe
from lowbit.ops.dispatch import grouped_kind
from lowbit.verify.tolerance import element_error_bound, quantization_bounds
from moe_fixtures import FAMILIES, tiny_moe

L_SILU = 1.0998       # max_z d/dz [z sigmoid(z)] (at z ~ 2.40), rounded up
U64, U32 = 2.0 ** -53, 2.0 ** -24


def gamma(n: int, u: float) -> float:
    return n * u / (1 - n * u)


def _experts(family, rng, **kw):
    model = tiny_moe(family, rng, **kw)
    name, spec = next(iter(find_experts(model).items()))
    return model, name, spec, model.get_submodule(name)


def _route(model, name, spec, x):
    """top-k indices and weights from the family's own router on x."""
    _, router = router_of(model, name, spec)
    _, weights, index = router(x)
    return index, weights.to(x.dtype)


def _enk(w, spec):
    return w if spec.layout == "enk" else w.transpose(1, 2)


def _split(h, spec):
    return h.chunk(2, dim=-1) if spec.glu_split == "chunk" else (h[..., ::2], h[..., 1::2])


def _bound(mod, spec, x, index, weights, *, ex, eW1, eW2, ea_fn, u):
    """Element-wise bound [T, H] on |out_1 - out_2| (module docstring); ea_fn(a_abs, da) -> extra
    per-element error of the intermediate (its quantization), or 0."""
    W1 = _enk(mod.gate_up_proj.detach(), spec).double()
    W2 = _enk(mod.down_proj.detach(), spec).double()
    b1 = getattr(mod, spec.gate_up_bias).detach().double() if spec.gate_up_bias else None
    T, H = x.shape
    I = W2.shape[2]
    out = torch.zeros(T, H, dtype=torch.float64)
    ax = x.abs().double()
    for t in range(T):
        for j in range(index.shape[1]):
            e = int(index[t, j])
            h = x[t].double() @ W1[e].T + (0 if b1 is None else b1[e])
            axe = ax[t] + ex[t]
            dh = ex[t] @ W1[e].abs().T + axe @ eW1[e].T + gamma(H + 1, u) * (axe @ (W1[e].abs() + eW1[e]).T)
            g, up = _split(h, spec)
            dg, du = _split(dh, spec)
            if spec.activation == "act_fn":
                act_g = torch.nn.functional.silu(g)
                a = act_g * up
                da = L_SILU * dg * (up.abs() + du) + act_g.abs() * du
            else:
                gc, uc = g.clamp(max=mod.limit), up.clamp(-mod.limit, mod.limit)
                glu = gc * torch.sigmoid(gc * mod.alpha)
                a = (uc + 1) * glu
                da = L_SILU * dg * ((uc + 1).abs() + du) + glu.abs() * du
            da = da + 4 * u * a.abs() + ea_fn(a.abs(), da)
            aa = a.abs() + da
            dy = da @ W2[e].abs().T + aa @ eW2[e].T + gamma(I + 1, u) * (aa @ (W2[e].abs() + eW2[e]).T)
            out[t] += weights[t, j].abs().double() * dy
    return out + 4 * u * out.abs().max()


def _quant(mod, spec, recipe):
    r = get_recipe(recipe)
    return QuantExperts.from_module(mod, r.weight, r.act, gate_up=spec.gate_up, down=spec.down, layout=spec.layout,
                                    gate_up_bias=spec.gate_up_bias, down_bias=spec.down_bias, glu_split=spec.glu_split,
                                    activation=spec.activation, family=spec.family)


def _input(model, rng, T):
    return torch.randn(T, model.config.hidden_size, generator=rng, dtype=torch.float64)


@pytest.mark.parametrize("recipe", ["w8a16-int8", "w4a16-g32"])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_forward_with_dequantized_weights_is_matched(family, recipe, rng):
    """Weight-only: QuantExperts == the family's own experts forward (transformers' code, its
    own routing loop and activation) run on the dequantized weights, up to float64 rounding."""
    model, name, spec, mod = _experts(family, rng)
    q = _quant(mod, spec, recipe)
    x = _input(model, rng, 13)
    index, weights = _route(model, name, spec, x)
    ref = copy.deepcopy(mod)
    with torch.no_grad():
        for p, proj in ((spec.gate_up, "gate_up"), (spec.down, "down")):
            deq = q.weight_dequantized(proj, torch.float64)     # exact: codes x float32 scales
            getattr(ref, p).copy_(deq if spec.layout == "enk" else deq.transpose(1, 2))
    got, want = q(x, index, weights), ref(x, index, weights)
    zero = lambda w: torch.zeros_like(_enk(w.detach(), spec), dtype=torch.float64)  # noqa: E731
    ex = torch.zeros_like(x)
    # only the summation order differs: the bound with zero quantization error and u = 2^-53
    tol = _bound(ref, spec, x, index, weights, ex=ex, eW1=zero(ref.gate_up_proj), eW2=zero(ref.down_proj),
                 ea_fn=lambda a, d: 0, u=U64)
    assert q.last_path == "exact"
    assert ((got - want).abs() <= tol).all(), float(((got - want).abs() / tol).max())


RECIPES = ["w8a16-int8", "w4a16-g32", "w8a8-int8", "w8a8-int8-tensor", "w8a8-fp8", "mxfp8", "mxfp4", "nvfp4"]


def _gemm_check(got, x, w, b, xq, wq, E_wrong):
    """got [M, N] (float64, QuantExperts' rows of one expert) against the float GEMM
    x @ w.T + b within lowbit.verify.tolerance.quantization_bounds (the recipe's derived
    per-element bound: sum_k E_x W + X E_w + E_x E_w), plus x's rounding to float32 before it is
    quantized (u32 |x| |w|) and float64's own accumulation (gamma_K(u64) |x| |w|). Returns the
    whether the same rows times another expert's weight would break the bound (its teeth)."""
    want = x @ w.T + (0 if b is None else b)
    det, _ = quantization_bounds(x.float().double(), w, xq, wq)
    mag = x.abs() @ w.abs().T
    tol = det + (U32 + gamma(x.shape[1] + 1, U64)) * mag * 2
    err = (got - want).abs()
    assert (err <= tol).all(), float((err / tol).max())
    return bool(((x @ E_wrong.T + (0 if b is None else b) - want).abs() > tol).any())


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_each_grouped_gemm_within_the_recipes_bound_of_float(family, recipe, rng):
    """Both grouped GEMMs of every expert against the float GEMM on the same rows, within the
    bound derived from the recipe's schemes (weights per expert, activations quantized once
    over the whole input / sorted intermediate buffer)."""
    model, name, spec, mod = _experts(family, rng)
    r = get_recipe(recipe)
    q = _quant(mod, spec, recipe)
    x = _input(model, rng, 11)
    index, _ = _route(model, name, spec, x)
    routing = sort_tokens(index, q.num_experts)
    W1, W2 = _enk(mod.gate_up_proj.detach(), spec).double(), _enk(mod.down_proj.detach(), spec).double()
    b1 = getattr(mod, spec.gate_up_bias).detach().double() if spec.gate_up_bias else None
    b2 = getattr(mod, spec.down_bias).detach().double() if spec.down_bias else None
    h = q.gate_up_rows(x, routing)
    a = q.glu(h)
    y = q.down_rows(a, routing)
    xq_all = None if r.act is None else quantize(x.float(), r.act)
    aq_all = None if r.act is None else quantize(a, r.act)
    off = routing.offsets.tolist()
    teeth = []
    for e in range(q.num_experts):
        rows = torch.arange(off[e], off[e + 1])
        if not rows.numel():
            continue
        xe = x[routing.token[rows]]
        other = (e + 1) % q.num_experts
        teeth.append(_gemm_check(h[rows], xe, W1[e], None if b1 is None else b1[e],
                                 None if xq_all is None else take_rows(xq_all, routing.token[rows]),
                                 q.weight_q("gate_up", e), W1[other]))
        teeth.append(_gemm_check(y[rows], a[rows], W2[e], None if b2 is None else b2[e],
                                 None if aq_all is None else take_rows(aq_all, rows), q.weight_q("down", e),
                                 W2[other]))
    # A worst-case bound at K = 64 separates another expert's output from this one's for int8
    # (u = 1/254); for fp8 (u = 2^-4) and 4-bit formats it does not, and the exact comparison with
    # the family's own forward (the test above) is what catches a wrong expert there.
    if max(r.weight.fmt.unit_roundoff, 0 if r.act is None else r.act.fmt.unit_roundoff) < 2 ** -7:
        assert any(teeth)


def test_bad_input_gets_clear_errors(rng):
    model, name, spec, mod = _experts("mixtral", rng)
    with pytest.raises(ValueError, match=r"gate_up_proj.*K = 64.*group size 128"):
        _quant(mod, spec, "w4a16")                                  # K = 64, groups of 128
    q = _quant(mod, spec, "w8a8-int8")
    x = _input(model, rng, 5)
    with pytest.raises(ValueError, match="0 tokens"):
        q(x[:0], torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="top_k = 9"):
        q(x, torch.zeros(5, 9, dtype=torch.long), torch.ones(5, 9, dtype=torch.float64))
    with pytest.raises(ValueError, match="expert ids in"):
        q(x, torch.full((5, 2), 11), torch.ones(5, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="hidden_states must be"):
        q(x[:, :10], torch.zeros(5, 2, dtype=torch.long), torch.ones(5, 2, dtype=torch.float64))
    with torch.no_grad():
        mod.down_proj[3, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="down_proj.*NaN/Inf"):
        _quant(mod, spec, "w8a8-int8")
    with pytest.raises(ValueError, match="act_scheme must be dynamic"):
        QuantExperts.from_module(mod, get_recipe("w8a8-int8").weight,
                                 get_recipe("w8a8-int8").act.__class__(format="int8", strategy="tensor"))


def test_unknown_fused_experts_module_is_refused():
    class MyExperts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w_in = torch.nn.Parameter(torch.zeros(4, 16, 8))

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), MyExperts())
    with pytest.raises(ValueError, match=r"1 \(MyExperts\).*no entry for MyExperts"):
        find_experts(model)


def test_dropped_slots_and_empty_experts(rng):
    """Index E marks a dropped slot (no row); experts no token picked contribute nothing."""
    r = sort_tokens(torch.tensor([[0, 3], [3, 4], [4, 0]]), 4)
    assert r.token.tolist() == [0, 2, 0, 1] and r.slot.tolist() == [0, 1, 1, 0]
    assert r.offsets.tolist() == [0, 2, 2, 2, 4]
    model, name, spec, mod = _experts("qwen3_moe", rng)
    q = _quant(mod, spec, "w8a16-int8")
    x = _input(model, rng, 6)
    index = torch.full((6, 2), 7)
    index[:, 1] = 8                                                 # every second slot dropped
    w = torch.rand(6, 2, generator=rng, dtype=torch.float64)
    full = q(x, index, w)
    alone = q(x, index[:, :1], w[:, :1])
    assert torch.equal(full, alone)


KERNEL_CASES = [("mixtral", r) for r in RECIPES] + [("gpt_oss", "w8a8-int8"), ("gpt_oss", "w4a16-g32")]


@pytest.mark.parametrize("family,recipe", KERNEL_CASES)
def test_grouped_kernel_path_matches_exact_path(family, recipe, rng):
    """backend="kernel" (Triton's interpreter here, CUDA in service) against the exact path on
    the same module, for every recipe (each has a grouped kernel: lowbit.ops.dispatch.grouped_kind),
    within the bound of the module docstring with the float32 unit (the kernel path's
    accumulation, activation and routing sum) and, with quantized activations, the quantization
    of the intermediate on both sides (_act_requant)."""
    model, name, spec, mod = _experts(family, rng, dtype=torch.float32)
    r = get_recipe(recipe)
    q = _quant(mod, spec, recipe)
    q.backend = "kernel"
    x = torch.randn(13, model.config.hidden_size, generator=rng)
    index, weights = _route(model, name, spec, x)
    dev = "cuda" if torch.cuda.is_available() else "cpu"     # the kernels on the GPU where there is one
    got = q.to(dev)(x.to(dev), index.to(dev), weights.to(dev)).cpu()
    q.to("cpu")
    assert q.last_path == "kernel:" + grouped_kind(r.weight, r.act)
    q.backend = "exact"
    want = q(x, index, weights)
    assert q.last_path == "exact"
    twin = copy.deepcopy(mod).double()
    with torch.no_grad():
        for p, proj in ((spec.gate_up, "gate_up"), (spec.down, "down")):
            deq = q.weight_dequantized(proj, torch.float64)
            getattr(twin, p).copy_(deq if spec.layout == "enk" else deq.transpose(1, 2))
    zero = lambda w: torch.zeros_like(_enk(w.detach(), spec), dtype=torch.float64)  # noqa: E731
    ea_fn = (lambda a, d: 0) if r.act is None else _act_requant(r.act, _buffer_amax(q, x, index))  # noqa: E731
    xd = x.double()
    xin = xd if r.act is None else lb_quant_dequant(xd, r.act)
    tol = _bound(twin, spec, xin, index, weights.double(), ex=torch.zeros_like(xd), eW1=zero(twin.gate_up_proj),
                 eW2=zero(twin.down_proj), ea_fn=ea_fn, u=U32)
    err = (got.double() - want.double()).abs()
    assert (err <= tol).all(), float((err / tol).max())


def _buffer_amax(q, x, index):
    """max |a| over the whole sorted intermediate (a per-tensor activation scale spans it)."""
    routing = sort_tokens(index, q.num_experts)
    return float(q.glu(q.gate_up_rows(x, routing)).abs().max())


def _act_requant(scheme, buffer_amax):
    """Extra error of the intermediate a when both paths quantize it but the kernel's float32 a
    differs from the exact one by up to d: |Q(a + d') - Q(a)| <= d + E(a) + E_k, with E the
    quantization error bound of lowbit.verify.tolerance.element_error_bound (per scale group;
    a per-tensor scheme's one group is the whole buffer, represented by its amax).
    The kernel side's groups have amax <= that of |a| + d and a scale at most twice that
    envelope's (an e8m0 scale rounds to powers of two): E_k <= 2 E(|a| + d)."""
    def err(v):
        v = v.reshape(1, -1)
        if scheme.strategy == "tensor":
            v = torch.cat([v, torch.full((1, 1), buffer_amax, dtype=v.dtype)], 1) * (1 + 4 * U32)
        b = element_error_bound(v, quantize(v.float(), scheme)).err
        return b.repeat_interleave(v.shape[1] // b.shape[1], dim=1).reshape(-1)[:a_len]

    def fn(a, d):
        nonlocal a_len
        a_len = a.numel()
        return (err(a) + 2 * err(a + d)) * (1 + 2 * U32)
    a_len = 0
    return fn


def lb_quant_dequant(x, scheme):
    """What both paths multiply: the activations' dequantized values (identical codes and scales)."""
    return quantize(x.float(), scheme).dequantize(torch.float64)


@pytest.mark.parametrize("recipe", ["w4a16-g32", "w8a16-int8"])
@pytest.mark.parametrize("path,T", [("kernel", 7), ("dequant", 40)])
def test_bf16_kernel_path_within_the_bf16_bound_of_the_exact_path(recipe, path, T, rng):
    """bf16 hidden states on the kernel path: the gate_up GEMM writes bf16 (one rounding of its fp32
    result), the activation runs in bf16 and the down GEMM reads it on the bf16 tensor-core dots
    (lowbit.nn.experts' docstring). Against the exact path on the same module within _bound with the
    bf16 unit for every rounding (each of the kernel path's roundings is at most that); the output
    is bf16, as the input. T = 40 tokens (80 sorted rows, a prefill bucket) take the bf16 path by
    the grouped heuristic: each weight is also rounded once to bf16 from its float32 value
    (eW = (2^-8 + 2 * 2^-24) |W|), and the down GEMM's output once to bf16 (within gamma_I's
    bf16 unit)."""
    from lowbit.ops import tuning
    model, name, spec, mod = _experts("mixtral", rng, dtype=torch.float32)
    q = _quant(mod, spec, recipe)
    x = torch.randn(T, model.config.hidden_size, generator=rng).to(torch.bfloat16)
    index, weights = _route(model, name, spec, x.float())
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q.backend = "kernel"
    tuning.reset(None, "no table: the heuristic decides (test)")
    try:
        got = q.to(dev)(x.to(dev), index.to(dev), weights.to(dev)).cpu()
    finally:
        tuning.reset()
    q.to("cpu")
    assert got.dtype == torch.bfloat16 and q.last_path == f"{path}:{q.kernel}"
    q.backend = "exact"
    want = q(x, index, weights)
    twin = copy.deepcopy(mod).double()
    with torch.no_grad():
        for p, proj in ((spec.gate_up, "gate_up"), (spec.down, "down")):
            deq = q.weight_dequantized(proj, torch.float64)
            getattr(twin, p).copy_(deq if spec.layout == "enk" else deq.transpose(1, 2))
    rho = 2.0 ** -8 + 2 * U32 if path == "dequant" else 0.0
    ew = lambda w: rho * _enk(w.detach(), spec).double().abs()  # noqa: E731
    xd = x.double()
    tol = _bound(twin, spec, xd, index, weights.double(), ex=torch.zeros_like(xd), eW1=ew(twin.gate_up_proj),
                 eW2=ew(twin.down_proj), ea_fn=lambda a, d: 0, u=2.0 ** -8)
    tol = tol + 2.0 ** -8 * (want.double().abs() + got.double().abs())     # both outputs rounded to bf16
    err = (got.double() - want.double()).abs()
    assert (err <= tol).all(), float((err / tol).max())


def test_kernel_forward_compiles_without_graph_breaks(rng):
    """torch.compile(fullgraph=True) of the kernel path: routing on the device with fixed shapes and
    the grouped GEMMs as the lowbit::grouped_gemm custom op; a host sync or a data-dependent
    shape would be a graph break, which fullgraph=True turns into an error. Same numbers as eager."""
    E, H, I, T, k = 3, 64, 32, 5, 2
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    m = torch.nn.Module()
    m.gate_up_proj = torch.nn.Parameter(torch.randn(E, 2 * I, H, generator=rng))
    m.down_proj = torch.nn.Parameter(torch.randn(E, H, I, generator=rng))
    m.act_fn = torch.nn.SiLU()
    r = get_recipe("w8a8-int8")
    q = QuantExperts.from_module(m, r.weight, r.act, backend="kernel").to(dev)
    x = torch.randn(T, H, generator=rng).to(dev)
    idx = torch.stack([torch.randperm(E, generator=rng)[:k] for _ in range(T)])
    idx[1, 1] = E                                               # a dropped slot
    w = torch.rand(T, k, generator=rng).to(dev)
    got = torch.compile(q, fullgraph=True, backend="eager")(x, idx.to(dev), w)
    assert q.last_path == "kernel:int8"
    assert torch.equal(got, q(x, idx.to(dev), w))


@pytest.mark.parametrize("recipe", RECIPES)
def test_device_holds_the_weight_once(recipe, rng):
    """`.to(device)` sends the kernel's operands; a 4-bit weight's stacked codes (one per byte, the
    exact twin weight_q reads) stay on the host, so the device holds the packed copy only; 8-bit
    kernels read the stacked codes themselves, which move. The meta device stands in for a GPU."""
    model, name, spec, mod = _experts("mixtral", rng, dtype=torch.float32)
    q = _quant(mod, spec, recipe)
    if q.kernel is None:
        pytest.skip(f"{recipe}: no grouped kernel")
    four_bit = q.kernel in ("w4a16", "fp4")
    assert q.host_twin == four_bit
    q.to("meta")
    on_dev = {n for n, b in q.named_buffers() if b.device.type == "meta"}
    for p in ("gate_up", "down"):
        codes = getattr(q, f"{p}_codes")
        assert (codes.device.type == "cpu") == four_bit, (p, codes.device)
        w = getattr(q, q._ops[p]["w"])
        assert w.device.type == "meta"
        if four_bit:            # two codes per byte on the device, nothing else of the twin there
            assert w.numel() * w.element_size() * 2 == codes.numel() * codes.element_size()
            assert not on_dev & q._twin


def test_host_twin_can_be_kept_with_the_kernel(rng):
    model, name, spec, mod = _experts("mixtral", rng, dtype=torch.float32)
    r = get_recipe("w4a16-g32")
    base = _quant(mod, spec, "w4a16-g32")
    q = QuantExperts(
        {p: {f: getattr(base, f"{p}_{f}") for f in ("codes", "scale", "zero", "scale_codes", "global")}
         for p in ("gate_up", "down")},
        {"gate_up": None, "down": None}, r.weight, r.act, glu_split=spec.glu_split, activation=spec.activation,
        act_fn=mod.act_fn, family=spec.family, host_twin=False)
    assert not q.host_twin
    q.to("meta")
    assert q.gate_up_codes.device.type == "meta" and q.down_codes.device.type == "meta"
