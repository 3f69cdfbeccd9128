"""append_kv (Triton; the interpreter here, CUDA on a GPU) writes one token's quantized states into a
preallocated cache bit for bit as lowbit.ops.kv_quant.quantize_kv quantizes them, at a position
read from a device tensor, and touches nothing else; fp8 codes are also checked against torch's own
float8_e4m3fn cast (an independent encoder)."""
import pytest
import torch

from lowbit.ops.kv_quant import KVQuant, KVScheme, observe_amax, quantize_kv, static_scale
from lowbit.ops.triton.kv_append import append_kv

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _states(rng, B, H, D, dtype):
    x = torch.randn(B, H, 1, D, generator=rng) * torch.rand(B, H, 1, 1, generator=rng) * 4
    x[0, 0] = 0.0                                   # an all-zero head: scale 1.0 (dynamic), codes 0
    return x.to(dtype)


@pytest.mark.parametrize("name", ["fp8", "fp8-head", "fp8-token", "int8", "int8-head", "int8-token"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_append_equals_quantize_kv(rng, name, dtype):
    sch = KVScheme.parse(name)
    B, H, T, D = 2, 3, 7, 40                        # D not a power of two: a masked tile
    calib = torch.randn(B, H, 5, D, generator=rng)
    base = quantize_kv(calib[:, :, :1].expand(B, H, T, D).contiguous(), sch,
                       None if sch.dynamic else static_scale(observe_amax(calib, sch), sch))
    cache = KVQuant(base.codes.clone().to(DEV), base.scale.clone().to(DEV), sch)
    x = _states(rng, B, H, D, dtype)
    if not sch.dynamic:
        x[1, -1, 0, :3] *= 1e3                      # beyond the static scale's range: saturated / clamped
    pos = int(torch.randint(0, T, (1,), generator=rng))
    append_kv(cache, x.to(DEV), torch.tensor([pos], dtype=torch.int32, device=DEV))
    want = quantize_kv(x, sch, None if sch.dynamic else base.scale)
    got_codes, got_scale = cache.codes.cpu(), cache.scale.cpu()
    assert torch.equal(got_codes[:, :, pos:pos + 1], want.codes)
    keep = [t for t in range(T) if t != pos]
    assert torch.equal(got_codes[:, :, keep], base.codes[:, :, keep])        # nothing else written
    if sch.dynamic:
        assert torch.equal(got_scale[:, :, pos:pos + 1], want.scale)
        assert torch.equal(got_scale[:, :, keep], base.scale[:, :, keep])
        assert torch.equal(got_scale[0, 0, pos], torch.ones(1))               # the zero head
    else:
        assert torch.equal(got_scale, base.scale)
    if sch.format == "fp8_e4m3fn":                  # torch's cast, saturated, as the independent encoder
        s = got_scale[:, :, pos:pos + 1] if sch.dynamic else got_scale
        ref = (x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        assert torch.equal(got_codes[:, :, pos:pos + 1], ref)


def test_append_refuses_bad_input(rng):
    sch = KVScheme.parse("fp8")
    cache = quantize_kv(torch.randn(1, 2, 4, 8, generator=rng), sch, torch.ones(1, 1, 1, 1))
    pos = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="one token"):
        append_kv(cache, torch.randn(1, 2, 2, 8), pos)
    with pytest.raises(ValueError, match="does not fit"):
        append_kv(cache, torch.randn(1, 3, 1, 8), pos)
    with pytest.raises(TypeError, match="pos must be"):
        append_kv(cache, torch.randn(1, 2, 1, 8), 0)
    g = quantize_kv(torch.randn(1, 2, 4, 32, generator=rng), KVScheme.parse("int4-g32"))
    with pytest.raises(ValueError, match="quantize_kv"):
        append_kv(g, torch.randn(1, 2, 1, 32), pos)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")    # the interpreter's numpy on NaN
@pytest.mark.parametrize("name", ["fp8", "int8-token"])
def test_append_records_the_first_nan_inf_row(rng, name):
    # bad[0] becomes min(bad[0], pos * B * H + b * H + h) over rows holding NaN / Inf; clean rows and
    # clean steps leave it alone, and the codes of the clean rows are still quantize_kv's
    sch = KVScheme.parse(name)
    B, H, T, D = 3, 2, 6, 24
    base = quantize_kv(torch.randn(B, H, T, D, generator=rng), sch, None if sch.dynamic else torch.ones(1, 1, 1, 1))
    cache = KVQuant(base.codes.clone().to(DEV), base.scale.clone().to(DEV), sch)
    clean = torch.iinfo(torch.int64).max
    bad = torch.full((2,), clean, dtype=torch.int64, device=DEV)
    x = _states(rng, B, H, D, torch.float32)
    append_kv(cache, x.to(DEV), torch.tensor([1], device=DEV), bad[1:])
    assert bad.tolist() == [clean, clean]
    rows = torch.randperm(B * H, generator=rng)[:2].tolist()
    y = _states(rng, B, H, D, torch.float32)
    for r, val in zip(rows, (float("nan"), float("-inf"))):
        y[r // H, r % H, 0, int(torch.randint(0, D, (1,), generator=rng))] = val
    pos = int(torch.randint(2, T, (1,), generator=rng))
    append_kv(cache, y.to(DEV), torch.tensor([pos], device=DEV), bad[1:])
    assert bad.tolist() == [clean, pos * B * H + min(rows)]
    ok = [r for r in range(B * H) if r not in rows]
    want = quantize_kv(y.reshape(B * H, 1, 1, D)[ok].reshape(1, len(ok), 1, D), sch,
                       None if sch.dynamic else torch.ones(1, 1, 1, 1))
    got = cache.codes.cpu()[:, :, pos].reshape(B * H, D)[ok]
    assert torch.equal(got, want.codes.reshape(len(ok), D))
    append_kv(cache, x.to(DEV), torch.tensor([0], device=DEV), bad[1:])      # a clean step, even at an earlier
    assert bad.tolist() == [clean, pos * B * H + min(rows)]                   # position, keeps the record
    with pytest.raises(TypeError, match="bad must be an int64"):
        append_kv(cache, x.to(DEV), torch.tensor([0], device=DEV), bad.to(torch.int32))


@pytest.mark.parametrize("name", ["int8", "int8-head"])
def test_static_int8_saturates_on_the_fast_division_path(rng, monkeypatch, name):
    """The GPU divides by FMA refinement and skips the clamp a dynamic scale never needs; a static
    scale's out-of-range quotients must still saturate to +-127 (unclamped, the int8 rounding trick
    wraps them: 127 became -117). Forced here in the interpreter too: saturated codes do not depend
    on the division's last ulp, which the interpreter's unfused FMA may miss."""
    import lowbit.ops.triton.kv_append as ka
    monkeypatch.setattr(ka, "interpreting", lambda: False)          # FAST=True: the GPU's branch
    sch = KVScheme.parse(name)
    B, H, T, D = 2, 3, 4, 40
    scale = static_scale(observe_amax(torch.randn(B, H, 5, D, generator=rng), sch), sch)
    cache = quantize_kv(torch.zeros(B, H, T, D), sch, scale)
    cache = KVQuant(cache.codes.to(DEV), cache.scale.to(DEV), sch)
    sign = torch.where(torch.rand(B, H, 1, D, generator=rng) < 0.5, -1.0, 1.0)
    ratio = 128 + torch.rand(B, H, 1, D, generator=rng) * 1e4               # |x / s| in (128, 10128)
    x = sign * ratio * scale                                                 # broadcast: per tensor or head
    pos = int(torch.randint(0, T, (1,), generator=rng))
    append_kv(cache, x.to(DEV), torch.tensor([pos], dtype=torch.int32, device=DEV))
    assert torch.equal(cache.codes.cpu()[:, :, pos:pos + 1], (sign * 127).to(torch.int8))
