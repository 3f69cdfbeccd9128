"""GPTQ: the fast blocked/Cholesky implementation against a straightforward float64 implementation
of the paper's per-column update (explicit inverse Hessian, downdated after every column), for
every weight scheme lowbit has; its output loss never above round-to-nearest's on the same H;
the stored codes are lowbit.quantize's; the model-level pass calibrates each layer on the outputs
of the layers already quantized before it."""
import copy
import dataclasses

import pytest
import torch

import lowbit as lb
from lowbit.algorithms.gptq.hessian import HessianAccumulator, held_out_losses, output_loss, panel_losses
from lowbit.algorithms.gptq.model import gptq_model
from lowbit.algorithms.gptq.solver import gptq_quantize_weight
from lowbit.nn.quant_linear import QuantLinear
from lowbit.algorithms.sequential import calibrate_sequentially
from lowbit.quantize import Scales, compute_scale, expand_scale, quantize, reduce_amax

SCHEMES = {
    "int4-g8": lb.QuantScheme(format="int4", strategy="group", group_size=8),
    "int4-g8-asym": lb.QuantScheme(format="int4", strategy="group", group_size=8, symmetric=False),
    "uint4-g16-asym": lb.QuantScheme(format="uint4", strategy="group", group_size=16, symmetric=False),
    "int8-channel": lb.QuantScheme(format="int8", strategy="channel"),
    "fp8-channel": lb.QuantScheme(format="fp8_e4m3fn", strategy="channel"),
    "fp8-tensor": lb.get_preset("fp8_tensor"),
    "mxfp4": lb.get_preset("mxfp4"),
    "nvfp4": lb.get_preset("nvfp4"),
}


def _column_of(qt, j, shape):
    ex = lambda t: None if t is None else expand_scale(t, qt.scheme, shape)[:, j:j + 1].contiguous()  # noqa: E731
    return Scales(ex(qt.scale), ex(qt.zero_point), ex(qt.scale_codes), qt.global_scale)


def reference_gptq(w, h, scheme, damp, act_order):
    """The paper's update written out in float64, one column at a time (O(K^2) per column):
    q_j = quant(w_j); W[:, F] -= (w_j - q_j) / Hinv_jj * Hinv_{j,F};
    Hinv <- Hinv - Hinv_{:,j} Hinv_{j,:} / Hinv_jj  (the inverse Hessian of the remaining columns).
    Group scales are taken from the group's current columns when the group is reached (unless
    act_order: then round-to-nearest's). Returns the codes [N, K]."""
    N, K = w.shape
    H = h.double().clone()
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1
    perm = torch.argsort(torch.diagonal(H), descending=True, stable=True) if act_order else torch.arange(K)
    Hp = H[perm][:, perm]
    Hp += damp * torch.diagonal(Hp).mean() * torch.eye(K, dtype=torch.float64)
    Hinv = torch.linalg.inv(Hp)
    W = w.double().clone()
    rtn = quantize(w.float(), scheme, pad=True)
    col_scheme = dataclasses.replace(scheme, strategy="group", group_size=1, block_size=None)
    dynamic = scheme.strategy == "group" and not act_order
    g = scheme.group_size
    codes = torch.zeros(N, K, dtype=rtn.codes.dtype)
    group_q = None
    for idx in range(K):
        j = int(perm[idx])
        if dynamic:
            if j % g == 0:      # this group's scales, from its columns as they are now
                blk = torch.nn.functional.pad(W[:, j:j + g].float(), (0, g - W[:, j:j + g].shape[1]))
                sc = compute_scale(reduce_amax(blk, scheme), scheme, global_scale=rtn.global_scale) \
                    if scheme.symmetric else None
                group_q = quantize(blk, scheme, scales=sc)
            col = _column_of(group_q, j % g, (N, g))
        else:
            col = _column_of(rtn, j, tuple(rtn.codes.shape))
        qt = quantize(W[:, j:j + 1].float(), col_scheme, scales=col)
        q = qt.dequantize(torch.float64)[:, 0]
        codes[:, j] = qt.codes[:, 0]
        err = (W[:, j] - q) / Hinv[idx, idx]
        W[:, perm[idx + 1:]] -= err[:, None] * Hinv[idx, idx + 1:][None, :]
        Hinv = Hinv - Hinv[:, idx:idx + 1] @ Hinv[idx:idx + 1, :] / Hinv[idx, idx]
    return codes


def _layer_data(rng, N=7, K=45, n=60):
    """A weight and a Hessian of correlated inputs (X = Z A, n samples), K not a multiple of any
    group size used here, so every group scheme has a short last group."""
    A = torch.randn(K, K, generator=rng, dtype=torch.float64)
    X = torch.randn(n, K, generator=rng, dtype=torch.float64) @ A
    acc = HessianAccumulator(K)
    acc.add(X[: n // 2])
    acc.add(X[n // 2:])
    return torch.randn(N, K, generator=rng), acc.hessian(), X


@pytest.mark.parametrize("panel", [1024, 16])      # H^-1's factor in one panel, or in 3 (K = 45)
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("name", list(SCHEMES))
def test_matches_float64_reference(rng, name, act_order, panel, monkeypatch):
    from lowbit.algorithms.gptq import factor as gptq
    monkeypatch.setattr(gptq, "FACTOR_PANEL", panel)
    scheme = SCHEMES[name]
    w, h, X = _layer_data(rng)
    # accumulator = X^T X / n: two float64 summation orders of n products differ by at most
    # 2 gamma_n (|X|^T |X|) / n, gamma_n = n u / (1 - n u) with u = 2^-53.
    n, u = X.shape[0], 2.0 ** -53
    bound = 2 * (n * u / (1 - n * u)) * (X.abs().T @ X.abs()) / n
    assert ((h - X.T @ X / n).abs() <= bound).all()
    res = gptq_quantize_weight(w, h, scheme, act_order=act_order, block_size=16)
    K = w.shape[1]
    # Codes bit-exact: both implementations feed the same float32 column values to the same
    # quantizer unless float64 rounding differences (~1e-16 relative) straddle a rounding
    # boundary of the float32 column, an event of probability ~1e-9 per element.
    assert torch.equal(res.qtensor.codes[:, :K], reference_gptq(w, h, scheme, 0.01, act_order))
    # GPTQ minimises the output loss greedily from RTN's starting point: never worse on its H.
    assert res.loss <= res.loss_rtn
    assert res.loss == output_loss(w, res.qtensor.dequantize(torch.float64), h)


def test_held_out_losses_are_the_held_out_hessians(rng):
    """held_out_losses (sum_t ||D x_t||^2 from the held-out tokens, batch by batch) is
    output_loss on the held-out tokens' Hessian X^T X, up to float64 rounding."""
    K, N, holdout = 37, 11, 4
    xs = [torch.randn(2, 9, K, generator=rng) for _ in range(3)]      # 18 tokens per batch
    w = torch.randn(N, K, generator=rng, dtype=torch.float64)
    ds = [w - (w + 0.01 * torch.randn(N, K, generator=rng, dtype=torch.float64)), w - w.float().bfloat16().double()]
    got = held_out_losses(xs, holdout, ds)
    xv = torch.cat([x.reshape(-1, K)[holdout - 1::holdout] for x in xs]).double()   # rows 3, 7, 11, 15
    T, B, u = xv.shape[0], len(xs), 2.0 ** -53
    for g, d in zip(got, ds):
        want = output_loss(w, w - d, xv.T @ xv)
        # Both are float64 evaluations of sum_{t,n} (x_t . d_n)^2. With M = sum_{t,n} (|x_t| . |d_n|)^2:
        # from the tokens, each dot product errs by <= gamma_K |x_t|.|d_n|, its square by <= 3 gamma_K
        # (|x_t|.|d_n|)^2 + u, the sums of T N nonnegative squares and B batch terms by gamma_{TN + B}:
        # <= (3K + 1 + TN + B) u' M. Through X^T X: H errs by gamma_T |X|^T |X|, D H by
        # gamma_K |D| |H| more, the sum of N K products by gamma_{NK}: <= (T + K + NK) u' M.
        # u' = u / (1 - m u) < 1.01 u for these m.
        M = float(((xv.abs() @ d.abs().T) ** 2).sum())
        tol = (T + 4 * K + N * K + T * N + B + 1) * 1.01 * u * M
        assert abs(float(g) - want) <= tol, (float(g), want, tol)
    assert held_out_losses([x[:, :1] for x in xs], holdout, ds) is None     # 2 tokens a batch: none held out


def test_panel_losses_are_output_loss(rng, monkeypatch):
    """panel_losses (tr(D H D^T) as the exact sum of PANEL_ROWS-row panels' values) is output_loss
    up to float64 rounding, on panels that do not divide N."""
    from lowbit.algorithms.gptq import hessian as gptq
    monkeypatch.setattr(gptq, "PANEL_ROWS", 5)
    w, h, _ = _layer_data(rng, N=23)
    q = w.double() + 0.01 * torch.randn(w.shape, generator=rng, dtype=torch.float64)
    d = w.double() - q
    got, want = panel_losses(d, h), output_loss(w, q, h)
    # each is a float64 evaluation of sum_{n,k} (sum_j d_nj h_jk) d_nk: <= gamma_{K + NK} |D| |H| . |D|
    # (a panel's sum has fewer terms; fsum of the panels adds no error beyond one rounding: u)
    N, K = d.shape
    M = float(((d.abs() @ h.abs()) * d.abs()).sum())
    tol = 2 * (K + N * K + 1) * 1.01 * 2.0 ** -53 * M
    assert abs(got - want) <= tol, (got, want, tol)


@pytest.mark.parametrize("name", ["int4-g8", "int8-channel", "nvfp4"])
def test_stored_codes_are_lowbit_quantize(rng, name):
    """The QTensor is a plain lowbit.quantize layout: static scales are round-to-nearest's, and
    re-quantizing the dequantized weight with the stored scales gives the stored codes."""
    scheme = SCHEMES[name]
    w, h, _ = _layer_data(rng, N=9, K=50)
    res = gptq_quantize_weight(w, h, scheme, act_order=True)
    qt = res.qtensor
    rtn = quantize(w, scheme, pad=True)
    assert torch.equal(qt.scale, rtn.scale) and qt.codes.shape == rtn.codes.shape
    assert not torch.equal(qt.codes, rtn.codes)          # GPTQ did choose other codes
    again = quantize(qt.dequantize(), scheme, pad=True,
                     scales=Scales(qt.scale, qt.zero_point, qt.scale_codes, qt.global_scale))
    assert torch.equal(again.codes, qt.codes)


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "mxfp6_e3m2", "fp8-channel", "fp8_block128", "fp8-e5m2-g16"])
def test_grid_column_step_is_the_encode_step(rng, name, monkeypatch):
    """The column step of float formats rounds on the format's value grid (lowbit.formats.grid,
    a few operations per column) instead of encode + decode (~20): on a layer of fresh random
    data at weight magnitudes 1e-3 .. 1e2, with dynamic group scales and with act-order's fixed
    ones, codes, scales, scale codes, tensor scale and losses are bit for bit the encode step's.
    Each column's rounded values are the same floats, so the whole trajectory is the same."""
    from lowbit.formats import grid
    extra = {"mxfp6_e3m2": lb.get_preset("mxfp6_e3m2"), "fp8_block128": lb.get_preset("fp8_block128"),
             "fp8-e5m2-g16": lb.QuantScheme(format="fp8_e5m2", strategy="group", group_size=16)}
    scheme = extra.get(name) or SCHEMES[name]
    w, h, _ = _layer_data(rng, N=37, K=83)
    w = w * 10.0 ** float(torch.randint(-3, 3, (1,), generator=rng))
    calls = [0]
    nearest = grid.nearest

    def counted(x, fmt):
        calls[0] += 1
        return nearest(x, fmt)

    for act_order in (False, True):
        calls[0] = 0
        with monkeypatch.context() as m:
            m.setattr(grid, "nearest", counted)
            new = gptq_quantize_weight(w, h, scheme, act_order=act_order, block_size=32)
        assert calls[0] >= w.shape[1]        # every column went through the grid
        with monkeypatch.context() as m:
            m.setattr(grid, "supported", lambda fmt: False)     # the encode + decode step
            m.setattr(grid, "nearest", None)
            old = gptq_quantize_weight(w, h, scheme, act_order=act_order, block_size=32)
        for f in ("codes", "scale", "scale_codes", "global_scale"):
            a, b = getattr(new.qtensor, f), getattr(old.qtensor, f)
            assert (a is None and b is None) or torch.equal(a, b), f
        assert new.loss == old.loss and new.loss_rtn == old.loss_rtn


def test_group_is_each_weight_alone(rng, monkeypatch):
    """gptq_quantize_group: weights reading one input (one Hessian) with the same per-row scheme
    are solved as ONE concatenated weight, in fixed panels of rows that do not line up with the
    weights' own rows; each weight's codes and scales are bit for bit its own
    gptq_quantize_weight (GPTQ's rows are independent). NVFP4 (a per-weight global scale) and a
    per-tensor scale are solved alone within the group."""
    from lowbit.algorithms.gptq import hessian, solver as gptq
    monkeypatch.setattr(hessian, "PANEL_ROWS", int(torch.randint(1, 9, (1,), generator=rng)))
    w0, h, _ = _layer_data(rng, N=13, K=45)
    ws = [w0] + [torch.randn(n, 45, generator=rng) for n in (6, 9, 5, 7)]
    schemes = [SCHEMES[n] for n in ("int4-g8", "int4-g8", "nvfp4", "fp8-tensor", "int4-g8")]
    for act_order in (False, True):
        got = gptq.gptq_quantize_group(ws, h, schemes, act_order=act_order, block_size=16)
        for w, s, qt in zip(ws, schemes, got):
            ref = gptq_quantize_weight(w, h, s, act_order=act_order, block_size=16).qtensor
            assert torch.equal(qt.codes, ref.codes) and torch.equal(qt.scale, ref.scale)
            assert (qt.global_scale is None) == (ref.global_scale is None)


@pytest.mark.parametrize("name", ["int4-g8-asym", "int8-channel"])
def test_triton_block_kernel_is_the_torch_loop(rng, name, monkeypatch):
    """The column loop as one Triton kernel per block (lowbit.algorithms.gptq.block; the GPU, or Triton's
    interpreter on the CPU) gives the PyTorch loop's codes and losses bit for bit, at weight magnitudes from
    1e-3 to 1e2; and under BLOCK_KERNEL="auto" a kernel that disagrees at its first use is
    switched off and the PyTorch loop's values are kept."""
    from lowbit.algorithms.gptq import solver as gptq
    from lowbit.algorithms.gptq import block as gptq_block
    w, h, _ = _layer_data(rng, N=19, K=21)     # two blocks, the second short (the interpreter is slow)
    w = w * 10.0 ** float(torch.randint(-3, 3, (1,), generator=rng))
    dev = "cuda" if torch.cuda.is_available() else "cpu"   # GPTQ runs where the weight lives
    w, h = w.to(dev), h.to(dev)
    monkeypatch.setattr(gptq, "BLOCK_KERNEL", "torch")
    a = gptq_quantize_weight(w, h, SCHEMES[name], act_order=True, block_size=16)
    monkeypatch.setattr(gptq, "BLOCK_KERNEL", "triton")
    b = gptq_quantize_weight(w, h, SCHEMES[name], act_order=True, block_size=16)
    assert torch.equal(a.qtensor.codes, b.qtensor.codes) and a.loss == b.loss

    monkeypatch.setattr(gptq, "BLOCK_KERNEL", "auto")
    monkeypatch.setattr(gptq, "BLOCK_KERNEL_STATUS", "unused")
    monkeypatch.setattr(gptq_block, "run_block", lambda W1, Err1, *a: W1.add_(1.0))
    W1, s1 = torch.randn(5, 8, generator=rng, dtype=torch.float64), torch.rand(5, 8, generator=rng) + 0.5
    Hinv1 = torch.linalg.cholesky(torch.eye(8, dtype=torch.float64) * 2, upper=True)
    W_t, E_t, E1 = W1.clone(), torch.empty_like(W1), torch.empty_like(W1)
    gptq._block_torch(W_t, E_t, s1, None, Hinv1, SCHEMES["int8-channel"], None, 0)
    with pytest.warns(UserWarning, match="block kernel is off"):
        gptq._block_kernel(W1, E1, s1, None, Hinv1, SCHEMES["int8-channel"])
    assert gptq.BLOCK_KERNEL_STATUS.startswith("off: ") and "differ from the PyTorch loop" in gptq.BLOCK_KERNEL_STATUS
    assert torch.equal(W1, W_t) and torch.equal(E1, E_t)


def test_bad_input(rng):
    w, h, _ = _layer_data(rng)
    with pytest.raises(ValueError, match="h has shape"):
        gptq_quantize_weight(w, h[:-1, :-1], SCHEMES["int4-g8"])
    with pytest.raises(ValueError, match="damp"):
        gptq_quantize_weight(w, h, SCHEMES["int4-g8"], damp=0)
    with pytest.raises(ValueError, match="no calibration input"):
        HessianAccumulator(4).hessian()


def tiny_llama(rng, layers=2, intermediate=80):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=rng)))
    return LlamaForCausalLM(cfg).eval()


def linear_inputs(models, names, batches) -> list[dict]:
    """For each model, {name: [the input of Linear `name`, one tensor per batch]}: forward hooks,
    every model run on each batch in turn."""
    seen = [{} for _ in models]
    hooks = [m.get_submodule(n).register_forward_pre_hook(
        lambda mod, a, n=n, s=s: s.setdefault(n, []).append(a[0].detach())) for m, s in zip(models, seen) for n in names]
    try:
        with torch.no_grad():
            for b in batches:
                for m in models:
                    m(b)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _batches(rng, n=2, t=24):
    return [torch.randint(0, 97, (1, t), generator=rng) for _ in range(n)]


def test_sequential_order(rng):
    """Every layer is calibrated on what the model feeds it once all layers before it are
    quantized: the inputs a handler receives equal (bit-exactly) the inputs of that layer in
    the finished quantized model, and the first layer's equal the float model's."""
    model = tiny_llama(rng, layers=3)
    ref = copy.deepcopy(model)
    batches = _batches(rng)
    scheme = lb.QuantScheme(format="int4", strategy="group", group_size=16)
    got, order = {}, []

    def handle(names, xs):
        order.append(names)
        for n in names:
            got[n] = xs
        return {n: QuantLinear.from_linear(model.get_submodule(n), scheme) for n in names}

    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    calibrate_sequentially(model, names, batches, handle)
    assert order[:4] == [[f"model.layers.0.self_attn.{p}_proj" for p in "qkv"], ["model.layers.0.self_attn.o_proj"],
                         ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"], ["model.layers.0.mlp.down_proj"]]
    seen, float_seen = linear_inputs([model, ref], names, batches)
    for n in names:
        assert all(torch.equal(a, b) for a, b in zip(got[n], seen[n])), n
    q0 = "model.layers.0.self_attn.q_proj"
    assert all(torch.equal(a, b) for a, b in zip(got[q0], float_seen[q0]))
    last = "model.layers.2.mlp.down_proj"
    assert not all(torch.equal(a, b) for a, b in zip(got[last], float_seen[last]))


def test_reused_outputs_are_the_computed_ones(rng, monkeypatch):
    """The outputs the replaced Linears give again while a block is re-run for its later groups
    (sequential._Reuse) are the ones they compute: every handler input and the finished model's
    logits equal those of a run that reuses nothing, with fewer Linear computations."""
    import lowbit.algorithms.sequential as seq
    scheme = lb.QuantScheme(format="int4", strategy="group", group_size=16)
    batches = _batches(rng)
    base = tiny_llama(rng, layers=2)
    calls = [0]
    forward = QuantLinear.forward

    def counted(self, x):
        calls[0] += 1
        return forward(self, x)
    monkeypatch.setattr(QuantLinear, "forward", counted)

    def run(reuse_bytes):
        monkeypatch.setattr(seq, "REUSE_BYTES", reuse_bytes)
        model, got = copy.deepcopy(base), {}
        calls[0] = 0

        def handle(names, xs):
            got.update({n: xs for n in names})
            return {n: QuantLinear.from_linear(model.get_submodule(n), scheme) for n in names}
        names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
        calibrate_sequentially(model, names, batches, handle)
        assert not any("forward" in m.__dict__ for m in model.modules())    # nothing left wrapped
        with torch.no_grad():
            return got, calls[0], [model(b).logits for b in batches]
    default = seq.REUSE_BYTES
    fresh, n_fresh, out_fresh = run(0)
    reused, n_reused, out_reused = run(default)
    assert fresh.keys() == reused.keys()
    assert all(torch.equal(a, b) for n in fresh for a, b in zip(fresh[n], reused[n]))
    assert all(torch.equal(a, b) for a, b in zip(out_fresh, out_reused))
    assert n_reused < n_fresh


def test_gptq_model(rng):
    """Model level: every quantized layer's output loss on its calibration inputs is <= RTN's, the
    layers are QuantLinears with the recipe's schemes, lm_head stays float, and an error leaves
    the model as it was."""
    model = tiny_llama(rng)
    batches = _batches(rng)
    summary = lb.nn.quantize_model(model, "w4a16-g32", method="gptq", calib=batches)
    assert summary.method == "gptq" and len(summary.quantized) == 14
    for d in summary.quantized:
        ratio = float(d.reason.split("GPTQ output loss ")[1].split("x")[0])
        assert ratio <= 1.0, d
        assert isinstance(model.get_submodule(d.name), QuantLinear)
    assert isinstance(model.lm_head, torch.nn.Linear)

    fresh = tiny_llama(rng)
    with torch.no_grad():
        fresh.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    linears = {n: m for n, m in fresh.named_modules() if isinstance(m, torch.nn.Linear)}
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj"):
        gptq_model(fresh, "w4a16-g32", batches)
    assert {n: m for n, m in fresh.named_modules() if isinstance(m, torch.nn.Linear)} == linears
    assert not any(isinstance(m, QuantLinear) for m in fresh.modules())
    with pytest.raises(ValueError, match="calib"):
        lb.nn.quantize_model(tiny_llama(rng), "w4a16-g32", method="gptq")
    with pytest.raises(ValueError, match="method="):
        lb.nn.quantize_model(tiny_llama(rng), "w4a16-g32", method="awq2")


def test_rotated_gptq_checkpoint_loads_in_transformers(rng, tmp_path):
    """Rotation + GPTQ give an ordinary compressed-tensors checkpoint: transformers (with the real
    compressed-tensors) loads it, the decompressed weights equal lowbit's dequantized ones bit for
    bit, and the untied lm_head comes back as saved."""
    pytest.importorskip("compressed_tensors")
    from pipelines.test_compressed_tensors import load_with_transformers

    from lowbit.pipelines.checkpoint import save_compressed
    from lowbit.algorithms.rotation import rotate_model
    model = tiny_llama(rng, intermediate=96)    # compressed-tensors needs K % group == 0
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    rotate_model(model, seed=int(torch.randint(0, 1000, (1,), generator=rng)))
    lb.nn.quantize_model(model, "w4a16-g32", method="gptq", calib=_batches(rng))
    out = save_compressed(model, tmp_path / "ckpt", "w4a16-g32")
    hf = load_with_transformers(out, "compressed")
    assert not hf.config.tie_word_embeddings
    assert torch.equal(hf.lm_head.weight, model.lm_head.weight)
    assert torch.equal(hf.model.embed_tokens.weight, model.model.embed_tokens.weight)
    n = 0
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            assert torch.equal(hf.get_submodule(name).weight.data, m.weight_q.dequantize(hf.get_submodule(name).weight.dtype))
            n += 1
    assert n == 14


def test_fit_rows_are_the_rows_a_mask_keeps(seed):
    from lowbit.algorithms.gptq.hessian import _fit_rows
    g = torch.Generator().manual_seed(seed)
    for rows in (0, 1, 3, 4, 5, 17, 64):
        x = torch.randn(rows, 3, generator=g)
        for holdout in (0, 2, 3, 4, 7):
            keep = torch.ones(rows, dtype=torch.bool) if not holdout else torch.arange(rows) % holdout != holdout - 1
            assert torch.equal(_fit_rows(x, holdout), x[keep]), (rows, holdout)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuSOLVER's in-place factorization")
def test_factor_in_place_on_the_gpu_is_the_out_of_place_one(rng, monkeypatch):
    # gptq._factor factors J Hp J in place (cholesky_ex(A, out=(A, info)), A column-major): the
    # same bits as cholesky_ex into a new matrix, then the same in-place inverse
    from lowbit.algorithms.gptq import factor as gptq
    monkeypatch.setattr(gptq, "FACTOR_PANEL", 64)          # 5 panels for K = 300
    K = 300
    x = torch.randn(400, K, generator=rng, dtype=torch.float64) * torch.rand(K, generator=rng, dtype=torch.float64)
    x[:, 5] = 0
    h = (x.T @ x / 400).cuda()
    fac = gptq._factor(h, 0.01, True, h.device)
    d = torch.diagonal(h).clone()
    d = torch.where(d == 0, torch.ones_like(d), d)
    perm = torch.argsort(d, descending=True, stable=True)
    rev = perm.flip(0)
    A = h[rev[:, None], rev]
    A.diagonal().copy_(d[rev] + 0.01 * d[perm].mean())
    L, info = torch.linalg.cholesky_ex(A)
    assert int(info) == 0 and torch.equal(fac.perm, perm)
    assert torch.equal(fac.hinv, gptq._reversed_inverse_(L))
