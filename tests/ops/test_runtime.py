"""The prepared fast path (lowbit.ops.prepared) of every recipe against lowbit's float64
reference, the shared-input GEMMs against the per-layer path, and the compile path.
Kernels run in Triton's CPU interpreter in CI (backend="kernel") and on CUDA where present."""
import copy

import pytest
import torch

from lowbit.nn import QuantLinear, get_recipe, prepare_model

from lowbit.pipelines.quantize_model import quantize_model

from lowbit.ops import prepared as runtime
from lowbit.recipes.presets import LM_HEAD, RECIPES
from lowbit.ops.reference import qlinear_reference, sum_abs_products
from lowbit.quantize import quantize

U32 = 2.0 ** -24      # float32 unit roundoff
U_BF16 = 2.0 ** -8    # bf16 unit roundoff (8 significant bits), the output cast's relative error


def _layer(rng, n, k, recipe, device):
    lin = torch.nn.Linear(k, n)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=rng) * 0.05)
        lin.bias.copy_(torch.randn(n, generator=rng) * 0.1)
    r = get_recipe(recipe)
    return QuantLinear.from_linear(lin, r.weight, r.act, backend="kernel").to(device), r


def _acts(rng, m, k):
    x = torch.randn(m, k, generator=rng)
    x[:, int(torch.randint(0, k, (1,), generator=rng))] *= 30.0   # an outlier channel, as in LLMs
    return x.bfloat16()


def _bound(q, r, xf, ref, device, dequant_path=False):
    """|y - ref| bound of a fast-path output y (bf16) against the float64 reference.
    The activations' codes and scales equal lowbit.quantize's (the quantizers are bit-identical),
    the weights are exact in every kernel, so the error is: float32 accumulation (and the few
    fp32 epilogue roundings: scales, bias, per-group scale products, split-K partial sums),
    at most (K + 8) u32 sum|x||w| (Higham, with 8 spare roundings for the epilogue), plus, for
    fp8 on Hopper, the MMA's ~13-bit product alignment (K 2^-12 max_k|x_k w_k|, see
    test_quant_linear), plus the final cast to bf16: u_bf16 |y32| <= u_bf16 (|ref| + e32),
    which the factor (1 + u_bf16) on e32 covers."""
    K = xf.shape[1]
    xq = xf.double() if r.act is None else quantize(xf, r.act)
    S = sum_abs_products(xq, q.weight_q)
    e32 = (K + 8) * U32 * S
    if device == "cuda" and r.act is not None and r.act.format == "fp8_e4m3fn":
        xd = (xq.dequantize(torch.float64) if r.act is not None else xf.double()).abs()
        wd = q.weight_q.dequantize(torch.float64).abs()
        e32 = e32 + K * 2.0 ** -12 * (xd[:, None, :] * wd[None, :, :]).amax(dim=-1)
    if dequant_path:
        # dequantized-weight path: the bf16 GEMM's output is rounded (u_bf16 |x.w| <= u_bf16 S) before
        # the tensor scale and the bias are applied in fp32 -- with a bias that cancels, |x.w| can
        # exceed |ref|, so the term is in units of S; and each weight with an fp32 scale (int4
        # (q - z) * s, int8 / fp8 code * s) is rounded once to bf16 from its fp32 product
        # (|dw| <= u_bf16 |w| + the u32 product rounding the 8 spare roundings of e32 cover: another
        # u_bf16 S). Values with e8m0 / e4m3 block scales (MX, NVFP4) are exact in bf16.
        e32 = e32 + U_BF16 * S * (2 if r.weight.scale_format == "fp32" else 1)
    return U_BF16 * ref.abs() + (1 + U_BF16) * e32


@pytest.mark.parametrize("recipe", list(RECIPES.values()) + [LM_HEAD["fp8"]], ids=lambda r: r.name)
def test_fast_path_matches_reference(rng, kernel_device, recipe):
    """Every recipe's fast path (and the fp8 weight-only LM head's), bf16 in / bf16 out, at a
    shape that is no tile multiple."""
    M, K, N = 7, 256, 40
    q, r = _layer(rng, N, K, recipe, kernel_device)
    x = _acts(rng, M, K)
    y = q(x.to(kernel_device))
    assert q.last_path.startswith("fast:"), q.last_path
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    xf = x.float()
    xq = xf.double() if r.act is None else quantize(xf, r.act)
    ref = qlinear_reference(xq, q.weight_q, q.bias.detach().cpu())
    err = (y.double().cpu() - ref).abs()
    tol = _bound(q, r, xf, ref, kernel_device)
    assert (err <= tol).all(), f"{recipe}: max excess {(err - tol).max():.3e}"


def _install_table(cells, gpu_env=True):
    """A tuning table holding `cells` [(kind, N, K, bucket, path, config)], made the active one."""
    from lowbit.ops import tuning
    env = tuning.environment()
    table = tuning.Table(env, {("linear", k, n, kk, b): tuning.Cell("linear", k, n, kk, b, p, c)
                               for k, n, kk, b, p, c in cells})
    tuning.reset(table, "test table")
    return table


@pytest.fixture
def tuning_reset():
    from lowbit.ops import tuning
    yield
    tuning.reset()


@pytest.mark.parametrize("recipe", ["w4a16", "w4a16-asym", "mxfp4", "nvfp4", "mxfp8", "w8a16-int8", LM_HEAD["fp8"]],
                         ids=lambda r: getattr(r, "name", r))
def test_dequantized_weight_path(rng, kernel_device, recipe, monkeypatch, tuning_reset):
    """Where the tuning table says "dequant" (here a cell for this layer at 6 rows, so the
    interpreter runs it at a small shape), 4-bit, 8-bit weight-only and MXFP8 weights are
    dequantized into the reusable scratch buffer and multiplied by a bf16 GEMM; the fp4
    activations past fused.QDQ_MAX_ROWS (lowered to 2: NVFP4's tensor absmax reduced by torch first)."""
    from lowbit.ops import fused, scratch, tuning
    monkeypatch.setattr(fused, "QDQ_MAX_ROWS", 2)
    M, K, N = 6, 256, 40
    q, r = _layer(rng, N, K, recipe, kernel_device)
    spec = q.fast_spec
    _install_table([(tuning.kind_key(spec), N, K, tuning.bucket(M), "dequant", None)])
    x = _acts(rng, M, K)
    scratch.release()
    y = q(x.to(kernel_device))
    key = ((N, K), torch.bfloat16, str(y.device))
    assert list(scratch._BUFFERS) == [key], list(scratch._BUFFERS)   # the weight went through it
    ptr = scratch._BUFFERS[key].data_ptr()
    q(_acts(rng, M, K).to(kernel_device))                            # reused by the next call
    assert list(scratch._BUFFERS) == [key] and scratch._BUFFERS[key].data_ptr() == ptr
    xf = x.float()
    xq = xf.double() if r.act is None else quantize(xf, r.act)
    ref = qlinear_reference(xq, q.weight_q, q.bias.detach().cpu())
    err = (y.double().cpu() - ref).abs()
    tol = _bound(q, r, xf, ref, kernel_device, dequant_path=True)
    assert (err <= tol).all(), f"{recipe}: max excess {(err - tol).max():.3e}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("recipe", ["w8a8-int8", "w8a8-int8-tensor", "w8a8-fp8", "w8a16-int8", "w4a16"])
def test_decode_graph_replay_matches_direct_launches(rng, recipe):
    """Decode-sized eager calls replay a captured graph: fresh inputs at the same M give the
    direct launches' output (bit for bit where the kernel has one summation order; W4A16's
    split-K adds partial sums with atomics in any order, so there both are held to the bound),
    and earlier outputs are not overwritten by later replays."""
    from lowbit.ops import prepared as runtime
    q, r = _layer(rng, 72, 256, recipe, "cuda")
    ys = []
    for _ in range(3):
        x = _acts(rng, 5, 256)
        y = q(x.cuda())
        direct = runtime.run(q.fast_spec, x.cuda(), {n: getattr(q, "fast_" + n) for n in q.fast_spec.operands}, q.bias)
        if recipe == "w4a16":
            xf = x.float()
            ref = qlinear_reference(xf.double(), q.weight_q, q.bias.detach().cpu())
            tol = _bound(q, r, xf, ref, "cuda")
            assert ((y.double().cpu() - ref).abs() <= tol).all() and ((direct.double().cpu() - ref).abs() <= tol).all()
        else:
            assert torch.equal(y, direct)
        ys.append((y, y.clone()))
    assert len([k for k in q._graphs if k[0] == "graph"]) <= 1    # recorded plans replace the graph where they can
    assert all(torch.equal(a, b) for a, b in ys)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("recipe", ["w4a16", "mxfp4", "nvfp4"])
def test_reduce_overhead_compile_with_split_k(rng, recipe):
    """torch.compile(mode="reduce-overhead") records the W4A16 pairs kernel with split-K (K =
    4096: two programs per tile, their counters in a buffer) into torch's CUDA-graph trees: no
    allocation may outlive the recording (the persistent counter buffer once did: "tensor(s) in
    the cudagraph pool not tracked as outputs"), and every replay gives the eager output bit for
    bit (the split-K partials are summed in a fixed order)."""
    q, _ = _layer(rng, 200, 4096, recipe, "cuda")
    compiled = torch.compile(q, mode="reduce-overhead", dynamic=False)
    for _ in range(4):  # warm-up, recording, replays (the compiled call first: its first call allocates)
        x = _acts(rng, 1, 4096).cuda()
        got = compiled(x).clone()
        assert torch.equal(got, q(x))


def test_fast_path_keeps_operand_formats_and_no_float_copy(rng, kernel_device):
    """.to(bfloat16) converts neither fp8 codes nor fp32 scales; a 4-bit layer holds packed
    codes (half a byte per weight) on its device and never a dequantized float weight."""
    q, _ = _layer(rng, 48, 256, "w8a8-fp8", "cpu")
    q = q.to(torch.bfloat16)
    assert q.fast_w.dtype == torch.float8_e4m3fn and q.fast_w_scale.dtype == torch.float32
    assert q.fast_w.untyped_storage().data_ptr() == q.weight_q.codes.untyped_storage().data_ptr()
    q4, _ = _layer(rng, 48, 256, "w4a16", kernel_device)
    q4(_acts(rng, 3, 256).to(kernel_device))
    q4.check = True                            # the exact path: dequantizes per call, keeps nothing
    q4(_acts(rng, 3, 256).float().to(kernel_device))
    held = [t for t in list(q4.buffers()) + list(q4._cache.values()) if t.is_floating_point()]
    assert all(t.numel() < 48 * 256 for t in held), [tuple(t.shape) for t in held]
    assert q4.fast_packed.numel() == 48 * 256 // 2


def test_check_mode_runs_exact_path_and_catches_nan(rng):
    q, _ = _layer(rng, 16, 128, "w8a8-int8", "cpu")
    q.check = True
    x = _acts(rng, 4, 128)
    q(x)
    assert not q.last_path.startswith("fast:")
    x[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        q(x)


def _tiny_llama(rng, hidden=128, inter=256, layers=2, dtype=torch.bfloat16):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=layers, vocab_size=96)
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=rng)))
    return transformers.LlamaForCausalLM(cfg).to(dtype).eval()


@pytest.mark.parametrize("recipe", ["w8a8-int8", "w4a16"])
def test_merged_layers_hold_their_weights_once(rng, recipe):
    """A merged group's members give up their own operands to the shared copy: the model holds no
    more bytes merged than layer by layer (nothing else, such as the dispatch record, may keep a
    member's laid-out tensors alive; it once held every merged weight twice)."""
    from lowbit.bench.model_measure import resident_bytes
    model = _tiny_llama(rng, hidden=128, inter=256, layers=1)
    per_layer = copy.deepcopy(model)
    quantize_model(per_layer, recipe, backend="kernel", share_inputs=False)
    shared = copy.deepcopy(per_layer)
    prepare_model(shared)
    assert any(type(m).__name__ == "SharedGEMM" for m in shared.modules())
    cpu = torch.device("cpu")
    # the group's concatenated per-row scales (and zero points) are new tensors; its codes are not
    concatenated = sum(b.nbytes for m in shared.modules() if type(m).__name__ == "SharedGEMM"
                       for n, b in m.named_buffers() if n not in ("fast_w", "fast_packed"))
    assert resident_bytes(shared, cpu) <= resident_bytes(per_layer, cpu) + concatenated


@pytest.mark.parametrize("recipe,spread", [("w8a8-int8", 0), ("w8a8-int8-tensor", 0), ("w8a8-fp8", 0), ("w4a16", 0),
                                           ("mxfp4", 20), ("mxfp4", 70), ("nvfp4", 20)])
def test_shared_inputs_match_per_layer_path(rng, kernel_device, recipe, spread):
    """q/k/v and gate/up merged into one GEMM each. Every member's output is checked against the
    float64 reference within _bound (so per-layer and shared differ by at most twice it), and
    for int8 (exact integer accumulation, same codes) the whole model's logits are identical.
    MXFP4: q_proj's weights scaled by 2^-spread and k_proj's by 2^spread, so the members' folded
    scale offsets D differ and the merged weight needs its own (spread 70: none fits, unfolded).
    NVFP4: the members' weight tensor scales differ (by 2^40 here), so the merged GEMM takes them
    per output row and the activation's tensor scale separately."""
    hidden = 128 if recipe in ("w4a16", "mxfp4", "nvfp4") else 64   # whole chunks of 128; else small
    model = _tiny_llama(rng, hidden=hidden, inter=128, layers=1)
    if spread:
        with torch.no_grad():
            model.model.layers[0].self_attn.q_proj.weight.mul_(2.0 ** -spread)
            model.model.layers[0].self_attn.k_proj.weight.mul_(2.0 ** spread)
    per_layer = copy.deepcopy(model)
    quantize_model(per_layer, recipe, backend="kernel", share_inputs=False)
    shared = copy.deepcopy(per_layer)
    prepare_model(shared)
    merged = [m for m in shared.modules() if type(m).__name__ == "SharedGEMM"]
    assert merged
    if recipe == "mxfp4":
        assert (merged[0].spec.fp4_exp_offset is None) == (spread == 70), merged[0].spec
    if recipe == "nvfp4":
        assert merged[0].fast_global_scale.numel() == merged[0].spec.N      # one per row: the scales differ
    per_layer.to(kernel_device), shared.to(kernel_device)
    r = get_recipe(recipe)
    x = _acts(rng, 5, hidden).to(kernel_device)
    attn = shared.model.layers[0].self_attn
    # NVFP4 also past the one-kernel activation (> 64 rows), on the dequantized-weight path (the heuristic's
    # choice from 65 rows)
    for x in [x] + ([_acts(rng, 70, hidden).to(kernel_device), _acts(rng, 260, hidden).to(kernel_device)]
                    if recipe == "nvfp4" else []):
        for name in ("q_proj", "k_proj", "v_proj"):             # one input object: one shared GEMM
            q = getattr(attn, name)
            y = q(x)
            assert q.last_path.startswith("fast:")
            xf = x.float().cpu()
            xq = xf.double() if r.act is None else quantize(xf, r.act)
            ref = qlinear_reference(xq, q.weight_q, None if q.bias is None else q.bias.detach().float().cpu())
            # the dequantized weight's bf16 GEMM rounds its output
            big = runtime._choice(q.__dict__["_shared"][0].spec, len(x))[0] == "dequant"
            assert ((y.double().cpu() - ref).abs() <= _bound(q, r, xf, ref, kernel_device, big)).all(), (name, len(x))
    if recipe == "w8a8-int8":   # a short prompt: the interpreter runs every tile program in Python
        ids = torch.randint(0, 96, (1, 4), generator=rng).to(kernel_device)
        with torch.no_grad():
            assert torch.equal(per_layer(ids).logits, shared(ids).logits)


def test_compiled_model_has_no_graph_breaks(rng, kernel_device):
    """torch.compile traces a quantized model whole (the kernels are one custom op) and gives
    the eager output bit for bit (the same kernels run)."""
    model = _tiny_llama(rng, hidden=64, inter=128, layers=1)
    quantize_model(model, "w8a8-int8", backend="kernel")
    model.to(kernel_device)
    ids = torch.randint(0, 96, (1, 3), generator=rng).to(kernel_device)
    with torch.no_grad():
        eager = model(ids).logits
        compiled = torch.compile(model, backend="eager", fullgraph=True)(ids).logits
    assert torch.equal(eager, compiled)


def test_loaded_checkpoint_is_prepared(rng, tmp_path):
    """load_compressed(dir).to_model(dtype=...) gives prepared, input-sharing layers whose
    outputs equal the quantized model that was saved (same codes, same path on this device)."""
    from lowbit.pipelines.checkpoint import load_compressed, save_compressed
    from lowbit.nn.shared_input import SharedGEMM
    model = _tiny_llama(rng, hidden=64, inter=128, layers=1, dtype=torch.float32)
    quantize_model(model, "w8a8-int8")
    ids = torch.randint(0, 96, (1, 6), generator=rng)
    with torch.no_grad():
        before = model(ids).logits
    save_compressed(model, tmp_path / "ck", "w8a8-int8")
    loaded = load_compressed(tmp_path / "ck").to_model(dtype=torch.float32)
    assert sum(isinstance(m, SharedGEMM) for m in loaded.modules()) == 2
    assert loaded.model.layers[0].mlp.down_proj.fast_spec.kind == "w8a8"
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, before)
    bf = load_compressed(tmp_path / "ck").to_model(dtype=torch.bfloat16)
    assert bf.model.embed_tokens.weight.dtype == torch.bfloat16
    assert bf.model.layers[0].mlp.down_proj.fast_w.dtype == torch.int8   # q/k/v, gate/up: in the SharedGEMMs
