"""The H200's fp8 tensor-core accumulator written with integers and shifts (an independent
implementation of what lowbit.verify.accumulate simulates), for planted kernels in tests."""
import numpy as np
import torch


def hopper_fp8_mma(X, W, unit=2.0 ** -9, bits=14, promote=0):
    """What an H200's fp8 tensor core does (measured: benchmarks/results/fastaccum_probe_h200.npz), written with
    integers and shifts: every 32-wide MMA step aligns its products and the running sum to the
    largest of them and keeps `bits` significant bits (truncated toward zero); with promote > 0 the
    running sum is added into an fp32 accumulator and restarted every `promote` K (cuBLAS without
    fast accumulation). X, W: decoded e4m3 elements, multiples of unit (2^-9), so products are
    integers of unit^2."""
    xi = torch.round(X.double() / unit).long()
    wi = torch.round(W.double() / unit).long()
    acc = torch.zeros(X.shape[0], W.shape[0], dtype=torch.long)
    total = torch.zeros(acc.shape, dtype=torch.float32)
    bitlen = np.vectorize(lambda v: int(v).bit_length(), otypes=[np.int64])
    for a in range(0, X.shape[1], 32):
        terms = torch.cat([acc[..., None], xi[:, None, a:a + 32] * wi[None, :, a:a + 32]], dim=-1)
        top = torch.from_numpy(bitlen(terms.abs().amax(dim=-1).numpy()))
        shift = (top - bits).clamp(min=0)[..., None]
        acc = (torch.sign(terms) * ((terms.abs() >> shift) << shift)).sum(-1)
        if promote and (a + 32) % promote == 0:
            total, acc = total + (acc.double() * unit * unit).float(), torch.zeros_like(acc)
    return total.double() + acc.double() * unit * unit
