"""GPTQ (Frantar et al., 2022): quantize a Linear weight column by column, pushing each column's
rounding error onto the columns not yet quantized so that the layer's OUTPUT error on the
calibration inputs is small, not the weight error.

For a Linear y = x @ W.T with calibration inputs X [n, K] the layer's output loss of a quantized
weight Q is  tr((W - Q) H (W - Q)^T)  with  H = X^T X / n  [K, K]. Quantizing column j to q_j and
updating the columns that are still free by the optimal compensation (OBS)
    W[:, F] -= (w_j - q_j) / [H_F^-1]_jj * [H_F^-1]_{j, F}
is GPTQ's step. The implementation here is the paper's fast form: the rows of the upper
Cholesky factor of H^-1 give every [H_F^-1] row at once, and the updates are applied lazily in
blocks of `block_size` columns (one matrix product per block outside the block). Rows are
independent, so the weights that read one input are solved as one concatenated weight
(gptq_quantize_group), the lazy products run on fixed panels of PANEL_ROWS rows (the same bits
whether one process or N ranks, each with whole panels, solve them), and on CUDA a block's column
loop is one Triton kernel (lowbit.algorithms.gptq.block) instead of ~11 kernels per column.

The grid is the scheme's own quantizer: every column goes through `lowbit.quantize` with the
layer's scales (`Scales`, expanded to that column), and the stored QTensor is
`lowbit.quantize(U, scheme, scales=S, pad=True)` where U holds each column as it was when it was
quantized. The codes are therefore exactly what `lowbit.quantize` stores for those values and
scales; the arithmetic of the quantized layer is unchanged, GPTQ only chooses other codes.

Scales: for `strategy="group"` schemes a group's scales are computed (by `compute_scale`, the one
place of scale arithmetic) from the group's columns as they are when GPTQ reaches the group, as
in the paper ("dynamic" groups). With `act_order=True` (columns visited in order of decreasing
H_jj) or `static_groups=True` the scales are those round-to-nearest would use on the original
weight, fixed before the first column; fixed scales given by the caller (`scales`, e.g.
lowbit.algorithms.scale_search's MSE-optimal ones) are likewise used for every group. The permutation
of act-order only changes the ORDER in which columns are quantized; codes and scales are stored
in the original column order with the original contiguous groups, so the checkpoint stays a
plain compressed-tensors group layout (no g_idx). Channel / tensor / block scales and NVFP4's
tensor scale come from the original weight (or from the fixed scales). `sequential_gptq` (model
level) calibrates each layer on the outputs of the layers before it that are already quantized.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch

from lowbit.formats import decode, grid
from lowbit.algorithms import distributed
from lowbit.algorithms.distributed import ChunkedSum, OrderedSum
from lowbit.quantize import (QTensor, Scales, compute_scale, encode_scaled, expand_scale, quantize, reduce_amax,
                             reduce_minmax)
from lowbit.scheme import QuantScheme


class HessianAccumulator:
    """Running H = X^T X / n (float64 [K, K]) over calibration inputs X of any shape [..., K].

    The sum lives on the inputs' device (`device` overrides). Under torch.distributed each rank
    adds its own batches and `hessian()` returns the Hessian of ALL ranks' batches, bit-identical
    to one process adding them in order; it is then a collective call that every rank makes.
    counts: None -- one term X_b^T X_b per batch, added in batch order (lowbit.algorithms.distributed.
    OrderedSum: ranks > 0 hold one K x K term per batch until the chain reaches them); or every
    rank's number of add() calls (distributed.counts(len(batches)), a collective) -- the batches'
    products accumulated in place (addmm_) into chunks of consecutive batches, the chunks added in
    order (distributed.ChunkedSum): no K x K term per batch, and ranks > 0 hold a few chunk sums.
    The two orders give different bits; each is the same for any number of ranks."""

    def __init__(self, in_features: int, device=None, counts: list[int] | None = None):
        self.in_features = in_features
        self.device = device
        self._counts = counts
        self._sum = OrderedSum() if counts is None else None
        self.n = 0
        self._dist = distributed.active()
        self._total = None              # the ranks' combined sum, once reduce() ran (distributed)

    def _prep(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.detach().reshape(-1, x.shape[-1]).to(device=self.device or x.device, dtype=torch.float64)
        if x2.shape[1] != self.in_features:
            raise ValueError(f"calibration input has {x2.shape[1]} features, the layer has {self.in_features}")
        return x2

    def add(self, x: torch.Tensor) -> None:
        if self._total is not None:
            raise RuntimeError("HessianAccumulator.add after hessian(): the ranks' sums were already combined")
        if x.shape[-1] != self.in_features:
            raise ValueError(f"calibration input has {x.shape[-1]} features, the layer has {self.in_features}")
        if self._counts is None:
            x2 = self._prep(x)
            self._sum.add(x2.T @ x2)
        else:
            if self._sum is None:
                dev = self.device or x.device
                self._sum = ChunkedSum(self._counts, (self.in_features, self.in_features), dev)

            def into(s, x=x):             # on the chain for a batch whose chunk began on an earlier rank
                x2 = self._prep(x)
                s.addmm_(x2.T, x2)
            self._sum.add(into)
        self.n += x.reshape(-1, x.shape[-1]).shape[0]

    def _combined(self) -> torch.Tensor | None:
        if self._counts is None:
            return self._sum.total((self.in_features, self.in_features), self.device)
        if self._sum is None:           # no batch on this rank (a collective all the same)
            self._sum = ChunkedSum(self._counts, (self.in_features, self.in_features),
                                   self.device or distributed.comm_device())
        return self._sum.total()

    def reduce(self) -> None:
        """Combine the ranks' sums (a collective; a no-op in one process); idempotent."""
        if self._dist and self._total is None:
            total = self._combined()
            self.n = distributed.all_count(self.n)
            self._total = total if total is not None else torch.zeros(
                self.in_features, self.in_features, dtype=torch.float64, device=self.device)

    @property
    def sum(self) -> torch.Tensor:
        """X^T X over all inputs so far (all ranks': a collective under torch.distributed)."""
        if self._dist:
            self.reduce()
            return self._total
        s = self._combined() if self._sum is not None else None
        return torch.zeros(self.in_features, self.in_features, dtype=torch.float64, device=self.device) if s is None else s

    def hessian(self) -> torch.Tensor:
        s = self.sum
        if self.n == 0:
            raise ValueError("no calibration input reached this layer: GPTQ needs calibration batches")
        return s / self.n


@dataclass
class GPTQResult:
    """qtensor: the quantized weight (lowbit.quantize layout, padded along K like pad=True);
    loss / loss_rtn: tr((W-Q) H (W-Q)^T) for GPTQ and for round-to-nearest on the same H."""
    qtensor: QTensor
    loss: float
    loss_rtn: float


def _fake_quant(x: torch.Tensor, s: torch.Tensor, zp: torch.Tensor | None, s64: torch.Tensor,
                scheme: QuantScheme) -> torch.Tensor:
    """Dequantized float64 values of float32 `x` under its effective scales `s` (float32, x's
    shape or broadcastable; `s64` = s.double(), passed in so that a column loop converts once),
    zero points `zp` (int32 or None): the element step of lowbit.quantize (encode_scaled) and
    QuantTensor.dequantize's arithmetic, elementwise, for one column or a whole block. Float
    formats round on the format's value grid (lowbit.formats.grid: decode(encode()) bit for bit in
    a few operations; the column loop calls this once per column, and encode's ~20 elementwise
    passes were most of GPTQ's time under NVFP4)."""
    if scheme.type == "float" and grid.supported(scheme.fmt):
        return grid.nearest(x / s, scheme.fmt).double() * s64
    codes = encode_scaled(x / s, zp, scheme.fmt)
    vals = codes.double() if scheme.type == "int" else decode(codes, scheme.fmt).double()
    if zp is not None:
        vals = vals - zp.double()
    return vals * s64


def output_loss(w: torch.Tensor, q: torch.Tensor, h: torch.Tensor) -> float:
    """tr((W - Q) H (W - Q)^T) in float64: the summed squared output error over the calibration
    inputs (divided by n when H = X^T X / n)."""
    return float(_quad(w.double() - q.double(), h.double()))


def _quad(d: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """tr(D H D^T) of float64 D [n, K] and H [K, K], as a 0-dim tensor (no device sync)."""
    return ((d @ h) * d).sum()


def panel_losses(d: torch.Tensor, h: torch.Tensor, world: int = 1, me: int = 0) -> float:
    """tr(D H D^T) (float64 D [N, K], H [K, K]) as the correctly rounded sum (math.fsum) of its
    PANEL_ROWS-row panels' values: the same float whatever the number of ranks. With world > 1
    each rank computes its share of the panels (_rows_of) and the panel values are broadcast (a
    collective), so one [N, K] x [K, K] product is divided among the ranks."""
    N = d.shape[0]
    npan = -(-N // PANEL_ROWS)
    vals = torch.zeros(npan, dtype=torch.float64, device=d.device)
    lo, hi = distributed.share(npan, world, me)
    for p in range(lo, hi):
        vals[p] = _quad(d[p * PANEL_ROWS:(p + 1) * PANEL_ROWS], h)
    if world > 1:
        for r in range(world):
            a, b = distributed.share(npan, world, r)
            if b > a:
                distributed.broadcast_(vals[a:b], src=r)
    return math.fsum(vals.tolist())


def held_out_losses(inputs, holdout: int, deltas: list[torch.Tensor]) -> torch.Tensor | None:
    """float64 [len(deltas)]: for each D = W - Q [N, K] (float64) the summed squared output error
    over the held-out calibration tokens, sum_t ||D x_t||^2, i.e. tr(D Hv D^T) with Hv = X^T X of
    those tokens (output_loss on the un-normalized held-out Hessian), computed from the tokens:
    inputs are this rank's batches (tensors [..., K]); the held-out tokens of a batch are every
    holdout-th row of it flattened to [-1, K]. One [tokens, K] x [K, N] product per batch and D,
    the batches' terms summed in batch order over all ranks (OrderedSum: bit-identical to one
    process; a collective). No K x K Hessian is built. None when no rank has a held-out token."""
    acc = OrderedSum()
    for x in inputs:
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] >= holdout:       # rows holdout-1, 2 holdout-1, ...: a strided view
            xv = x2[holdout - 1::holdout].to(torch.float64)
            acc.add(torch.stack([(xv @ d.T).square().sum() for d in deltas]))
    return acc.total((len(deltas),), deltas[0].device)


def _fit_rows(x2: torch.Tensor, holdout: int) -> torch.Tensor:
    """The rows of x2 [rows, K] that are not held out (all but every holdout-th: row r is held out
    when r % holdout == holdout - 1), in order; all rows when holdout is 0. One gather by an
    index computed on the device (the j-th fit row is row j + j // (holdout - 1)): the rows a
    boolean mask would select, without its host synchronization."""
    if not holdout:
        return x2
    nfit = x2.shape[0] - x2.shape[0] // holdout
    j = torch.arange(nfit, device=x2.device)
    return x2.index_select(0, j + j // (holdout - 1))


def _scales_of(qt: QTensor) -> Scales:
    return Scales(qt.scale, qt.zero_point, qt.scale_codes, qt.global_scale)


def _group_scales(cols: torch.Tensor, scheme: QuantScheme, global_scale) -> Scales:
    """Scales of one group from its current columns [N, <= g] (zero-padded to g, as quantize(pad=True))."""
    g = scheme.group_size
    x = torch.nn.functional.pad(cols.float(), (0, g - cols.shape[1]))
    if scheme.symmetric:
        return compute_scale(reduce_amax(x, scheme), scheme, global_scale=global_scale)
    lo, hi = reduce_minmax(x, scheme)
    return compute_scale(hi, scheme, amin=lo)


def _expanded(sc: Scales, scheme: QuantScheme, shape) -> Scales:
    ex = lambda t: None if t is None else expand_scale(t, scheme, shape)  # noqa: E731
    return Scales(ex(sc.scale), ex(sc.zero_point), ex(sc.scale_codes), sc.global_scale)


def _set_group(full: Scales, gi: int, sc: Scales) -> None:
    for dst, src in zip(full[:3], sc[:3]):
        if dst is not None:
            dst[:, gi:gi + 1] = src


# Rows per lazy-update matrix product (W[:, later] -= Err @ Hinv[block, later]). GPTQ's rows are
# independent, so a weight's rows can be solved in pieces (the Linears reading one input as one
# concatenated weight, a weight's rows split across ranks); the per-column steps are elementwise,
# but a matrix product's rounding may depend on the shape it is given (a BLAS picks its kernel by
# shape). The products therefore always run on these fixed panels of rows, counted from the
# job's first row: one process and N ranks (each holding whole panels) give them the same
# operands and shapes, so the codes are bit-identical whatever the split.
PANEL_ROWS = 512


# Columns per panel of the triangular inverse in _factor (matrix products on whole blocks of
# this size). Fixed, like PANEL_ROWS: under torch.distributed each rank computes whole panels with
# the operands and shapes one process uses, so H^-1's factor has the same bits whatever the split.
FACTOR_PANEL = 1024


@dataclass
class _Factor:
    """What GPTQ derives from one Hessian, shared by every weight (and row) reading that input:
    the column order and the upper Cholesky factor of the damped, permuted H^-1 [K, K] float64."""
    perm: torch.Tensor
    order: list[int]
    hinv: torch.Tensor


def _factor(h: torch.Tensor, damp: float, act_order: bool, dev, world: int = 1, me: int = 0) -> _Factor:
    """The column order and U, the upper Cholesky factor of Hp^-1 (Hp: h with dead columns set to
    H_jj = 1, permuted, damped), without forming Hp^-1: with J the reversal of the columns,
    J Hp J = L L^T (lower Cholesky) gives Hp^-1 = (J L^-1 J)^T (J L^-1 J), and J L^-1 J is upper
    triangular with a positive diagonal, so it is U. Cost: one Cholesky (K^3 / 3 flop, on every
    rank) and one triangular inverse (K^3 / 3, by column panels shared out over the `world`
    ranks: _reversed_inverse_). The paper's way (Cholesky, cholesky_inverse, a second Cholesky)
    is ~4/3 K^3 on the CPU, ~8/3 K^3 on CUDA (where PyTorch's cholesky_inverse solves against
    the identity), all of it on every rank, with ~5 K x K matrices alive. Here ONE K x K matrix
    besides h: J Hp J is gathered into it, factored in place into L, inverted in place into
    L^-1 and turned into U in place (the same values as computing each into a new matrix)."""
    K = h.shape[0]
    d = torch.diagonal(h).to(device=dev, dtype=torch.float64)
    d = torch.where(d == 0, torch.ones_like(d), d)     # no input reaches a dead column: H_jj = 1
    perm = torch.argsort(d, descending=True, stable=True) if act_order else torch.arange(K, device=dev)
    rev = perm.flip(0)

    def reversed_damped():
        """J Hp J in one gather (one K x K allocation), its diagonal damped by a fraction of the
        mean, in the column-major layout that LAPACK / cuSOLVER factor in place (and that
        cholesky_ex returns): the row-major gather of its transpose, viewed transposed (h need
        not be bit-symmetric: a product X^T X's two triangles may round differently)."""
        m = h.to(device=dev, dtype=torch.float64).mT[rev[:, None], rev].mT
        m.diagonal().copy_(d[rev] + damp * d[perm].mean())
        return m
    A = reversed_damped()
    info = torch.zeros((), dtype=torch.int32, device=A.device)
    try:
        torch.linalg.cholesky_ex(A, out=(A, info))     # in place: A holds L (its upper triangle zeroed)
    except RuntimeError:      # a torch that refuses the aliased out=: the same factorization into a new matrix
        A, info = torch.linalg.cholesky_ex(reversed_damped())
    if info:
        raise ValueError(f"the damped Hessian is not positive definite (damp={damp}); raise damp (e.g. 0.1) "
                         "or give more calibration tokens")
    _reversed_inverse_(A, world, me)     # rows: [H_F^-1]_{j,F} / sqrt(.)
    # host copy of the order: the column loop indexes it without a device sync
    return _Factor(perm, perm.tolist(), A)


# Columns per step of the in-place reversal of L^-1 into U (a step's temporaries: 2 x columns x K
# float64; L is column-major, as cholesky_ex makes it, so a column block is one contiguous run).
_ROT_ROWS = 256


def _reversed_inverse_(L: torch.Tensor, world: int = 1, me: int = 0) -> torch.Tensor:
    """L [K, K] (lower triangular, positive diagonal, zeros above) replaced in place by
    J L^-1 J (upper triangular); returns L.

    L^-1 by column panels of FACTOR_PANEL columns: panel j holds D_j^-1 on its diagonal block
    (D_i: L's diagonal block i, inverted by a triangular solve) and, below it, block row after
    block row, X_ij = -D_i^-1 (L[i, j:i] @ X[j:i, j]): matrix products on whole blocks, K^3 / 3
    flop in all. Panel j reads only L's columns from j on, so once computed it is stored in
    place of L's column block j (panels in increasing order). L's layout (column-major from
    cholesky_ex) is kept, so every product sees the operands and strides it saw before. Panels are independent of each
    other: with world > 1 each rank computes its share (distributed.owners by cost,
    ~(panels after j)^2) and the panels are broadcast from their owners; one process computes
    every panel with the same operations, so the bits do not depend on the number of ranks (a
    collective when world > 1). Then J L^-1 J by swapping row r with row K-1-r reversed."""
    K = L.shape[0]
    edges = list(range(0, K, FACTOR_PANEL)) + [K]
    nb = len(edges) - 1
    owner = distributed.owners([float((nb - j) ** 2) for j in range(nb)], world) if world > 1 else [0] * nb
    first = min((j for j in range(nb) if owner[j] == me), default=nb)
    eye = torch.eye(min(FACTOR_PANEL, K), dtype=L.dtype, device=L.device)
    dinv = {i: torch.linalg.solve_triangular(L[a:b, a:b], eye[:b - a, :b - a], upper=False)
            for i, (a, b) in enumerate(zip(edges, edges[1:])) if i >= first}
    for j in range(nb):
        if owner[j] != me:
            continue
        a, b = edges[j], edges[j + 1]
        X = torch.empty(K - a, b - a, dtype=L.dtype, device=L.device)     # rows a.. of L^-1's panel j
        X[:b - a] = dinv[j]
        for i in range(j + 1, nb):
            c, e = edges[i], edges[i + 1]
            X[c - a:e - a] = -(dinv[i] @ (L[c:e, a:c] @ X[:c - a]))
        L[a:, a:b] = X            # rows above a stay L's zeros, as L^-1's
        del X
    del dinv
    if world > 1:       # after every rank computed its panels, in panel order
        for j in range(nb):
            a, b = edges[j], edges[j + 1]
            distributed.broadcast_(L[a:, a:b], src=owner[j])
    half = K // 2         # (J L^-1 J)[r, c] = L^-1[K-1-r, K-1-c]: exact copies, column c with K-1-c
    for a in range(0, half, _ROT_ROWS):
        b = min(a + _ROT_ROWS, half)
        left = L[:, a:b].clone()
        L[:, a:b] = L[:, K - b:K - a].flip(0, 1)
        L[:, K - b:K - a] = left.flip(0, 1)
        del left
    if K % 2:
        L[:, half] = L[:, half].flip(0)
    return L


# The column loop of a block: "auto" runs the Triton kernel (lowbit.algorithms.gptq.block: one launch per
# block instead of ~11 per column) on CUDA for integer formats with fixed scales, after checking
# once per process that it reproduces the PyTorch loop bit for bit on the first block it sees
# (any difference or error switches it off, see BLOCK_KERNEL_STATUS); "torch" never runs it;
# "triton" runs it wherever it applies (on the CPU in Triton's interpreter: the tests).
BLOCK_KERNEL = "auto"
BLOCK_KERNEL_STATUS = "unused"     # "unused", "on (checked)", or "off: <why>"


def _kernel_wanted(scheme: QuantScheme, dynamic_groups: bool, dev: torch.device) -> bool:
    if BLOCK_KERNEL not in ("auto", "torch", "triton"):
        raise ValueError(f"lowbit.algorithms.gptq.core.BLOCK_KERNEL={BLOCK_KERNEL!r}: choose 'auto', 'torch' or 'triton'")
    # the kernel's arithmetic: integer codes of at most 8 bits, scales fixed before the loop
    if BLOCK_KERNEL == "torch" or scheme.type != "int" or dynamic_groups or scheme.fmt.qmax > 255:
        return False
    if BLOCK_KERNEL == "triton":
        return True
    return dev.type == "cuda" and not BLOCK_KERNEL_STATUS.startswith("off")


def _block_kernel(W1, Err1, s1, z1, Hinv1, scheme) -> None:
    global BLOCK_KERNEL_STATUS
    from lowbit.algorithms.gptq import block as gptq_block
    if BLOCK_KERNEL == "triton" or BLOCK_KERNEL_STATUS.startswith("on"):
        gptq_block.run_block(W1, Err1, s1, z1, Hinv1, scheme)
        return
    if BLOCK_KERNEL_STATUS.startswith("off"):
        _block_torch(W1, Err1, s1, z1, Hinv1, scheme, None, 0)
        return
    # first use in this process: the kernel must give the PyTorch loop's bits, or it is not used
    W_t, E_t = W1.clone(), Err1.clone()
    _block_torch(W_t, E_t, s1, z1, Hinv1, scheme, None, 0)
    try:
        gptq_block.run_block(W1, Err1, s1, z1, Hinv1, scheme)
        bad = int((W1 != W_t).sum()) + int((Err1 != E_t).sum())
        BLOCK_KERNEL_STATUS = "on (checked)" if bad == 0 else \
            f"off: {bad} of {2 * W1.numel()} values differ from the PyTorch loop"
    except Exception as err:      # a compiler or driver problem: the PyTorch loop still works
        BLOCK_KERNEL_STATUS = f"off: {type(err).__name__}: {str(err)[:300]}"
    if not BLOCK_KERNEL_STATUS.startswith("on"):
        import warnings
        warnings.warn(f"GPTQ's Triton block kernel is {BLOCK_KERNEL_STATUS}; using the PyTorch loop", stacklevel=3)
        W1.copy_(W_t)
        Err1.copy_(E_t)


def _block_torch(W1, Err1, s1, z1, Hinv1, scheme: QuantScheme, full: Scales | None, i1: int) -> None:
    """The column loop of one block in PyTorch, in place (gptq_block.run_block's arguments).
    full: the Scales to fill for dynamic groups (then s1 / z1 are filled here as each group is
    reached: its scales from its columns as they are now), None when the scales are fixed."""
    g = scheme.group_size
    s64 = None if full is not None else s1.double()
    for i in range(W1.shape[1]):
        if full is not None and (i1 + i) % g == 0:
            sc = _group_scales(W1[:, i:i + g], scheme, full.global_scale)
            _set_group(full, (i1 + i) // g, sc)
            s1[:, i:i + g] = sc.scale
            if z1 is not None:
                z1[:, i:i + g] = sc.zero_point
            s64 = s1.double()
        x = W1[:, i]
        q = _fake_quant(x.float(), s1[:, i], None if z1 is None else z1[:, i], s64[:, i], scheme)
        torch.div(x - q, Hinv1[i, i], out=Err1[:, i])
        # column i itself is not updated: it is never read again, and it keeps its value as
        # quantized, which U records after the block
        W1[:, i + 1:] -= Err1[:, i:i + 1] * Hinv1[i:i + 1, i + 1:]


@contextlib.contextmanager
def _one_thread(dev: torch.device):
    """PyTorch's CPU ops on one thread for the duration (the previous count restored after).

    The column loop runs ~13 small elementwise ops per column on [n] vectors and one [n, < block]
    update; PyTorch splits the update (above its grain of 32,768 elements) over its intra-op
    threads, which buys nothing at this size, and on the shared 2-core machine under load each
    such split waited for a descheduled thread: measured at load ~8, one update of 1,536 x 127
    took 18-28 ms with 2 threads and 0.2-0.4 ms with 1. Elementwise results do not depend on the
    thread count, so the codes are the same. The count is process-wide while the loop runs."""
    n = torch.get_num_threads()
    if dev.type != "cpu" or n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _solve(w64: torch.Tensor, fac: _Factor, scheme: QuantScheme, full: Scales, dynamic_groups: bool,
           block_size: int, kp: int) -> torch.Tensor:
    """GPTQ's column loop on the rows w64 [n, K] (float64, original column order). full: the
    scales of these rows, [n, G] tensors (kp: the padded K of their codes); dynamic groups overwrite each group's when GPTQ reaches
    it (in place). Returns U [n, K] float32: each column as it was when it was quantized (the
    stored codes are lowbit.quantize(U, scheme, scales=full)).

    Per column only elementwise steps on [n] vectors run (the quantization of the column, its
    error, the update of the block's later columns); the update of the later blocks is one
    matrix product per block and PANEL_ROWS rows (the paper's lazy batch)."""
    n, K = w64.shape
    pshape = (n, kp)
    W = w64[:, fac.perm]                 # a copy (advanced indexing)
    U = torch.empty(n, K, dtype=torch.float32, device=w64.device)
    ex = None if dynamic_groups else _expanded(full, scheme, pshape)
    use_kernel = _kernel_wanted(scheme, dynamic_groups, W.device)
    for i1 in range(0, K, block_size):
        i2 = min(i1 + block_size, K)
        cols = fac.perm[i1:i2]
        W1 = W[:, i1:i2].clone()
        Err1 = torch.empty_like(W1)
        Hinv1 = fac.hinv[i1:i2, i1:i2]
        if dynamic_groups:      # columns in order, blocks of whole groups: filled as groups are reached
            s1 = torch.empty(n, i2 - i1, dtype=torch.float32, device=W.device)
            z1 = None if full.zero_point is None else torch.empty(n, i2 - i1, dtype=full.zero_point.dtype,
                                                                 device=W.device)
        else:
            s1 = ex.scale[:, cols].contiguous()
            z1 = None if ex.zero_point is None else ex.zero_point[:, cols]
        if use_kernel:
            _block_kernel(W1, Err1, s1, z1, Hinv1, scheme)
        else:
            with _one_thread(W.device):
                _block_torch(W1, Err1, s1, z1, Hinv1, scheme, full if dynamic_groups else None, i1)
        U[:, cols] = W1.float()
        if i2 < K:
            later = fac.hinv[i1:i2, i2:]
            for p0 in range(0, n, PANEL_ROWS):
                W[p0:p0 + PANEL_ROWS, i2:] -= Err1[p0:p0 + PANEL_ROWS] @ later
    return U


def _finish(U: torch.Tensor, full: Scales, scheme: QuantScheme) -> QTensor:
    """The stored QTensor of U under the scales GPTQ used, checked against the column step."""
    qt = quantize(U, scheme, pad=True, scales=full)
    deq = qt.dequantize(torch.float64)
    ex = _expanded(full, scheme, tuple(qt.codes.shape))
    K = U.shape[1]
    cut = lambda t: None if t is None else t[:, :K]  # noqa: E731
    want = _fake_quant(U, cut(ex.scale), cut(ex.zero_point), cut(ex.scale).double(), scheme)
    if not torch.equal(deq[:, :K], want):   # the column step and lowbit.quantize must be one arithmetic
        raise RuntimeError("GPTQ: the stored codes do not reproduce the values the updates assumed "
                           f"({int((deq[:, :K] != want).sum())} of {want.numel()} differ); this is a lowbit bug, "
                           "please report it")
    return qt


def _check(w: torch.Tensor, h: torch.Tensor, scheme: QuantScheme, damp: float, block_size: int) -> None:
    if w.ndim != 2:
        raise ValueError(f"w must be a 2-D [out_features, in_features] weight, got shape {tuple(w.shape)}")
    K = w.shape[1]
    if tuple(h.shape) != (K, K):
        raise ValueError(f"h has shape {tuple(h.shape)}; a weight with K={K} input features needs [{K}, {K}]")
    if not torch.isfinite(w).all() or not torch.isfinite(h).all():
        raise ValueError("w or h holds NaN/Inf: fix the checkpoint or the calibration inputs before GPTQ")
    if not damp > 0:
        raise ValueError(f"damp={damp} must be > 0 (fraction of mean(diag H) added to the diagonal; 0.01 typical)")
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    if scheme.dynamic:
        raise ValueError("scheme must be static (dynamic=False): weights are quantized once")


def _row_split(scheme: QuantScheme) -> bool:
    """Whether a weight's rows can be solved apart: per-row scales (channel / group)."""
    return scheme.strategy in ("channel", "group")


def _mergeable(a: QuantScheme, b: QuantScheme) -> bool:
    """Whether two weights reading one input can be solved as one concatenated weight: the same
    per-row scheme and no per-weight tensor scale (NVFP4's global scale is each weight's own)."""
    return a == b and _row_split(a) and not a.two_level


def _rows_of(n: int, world: int, r: int) -> tuple[int, int]:
    """Rank r's rows of an n-row job: whole PANEL_ROWS panels, contiguous, counts differing by
    at most one panel."""
    lo, hi = distributed.share(-(-n // PANEL_ROWS), world, r)
    return min(lo * PANEL_ROWS, n), min(hi * PANEL_ROWS, n)


def gptq_quantize_group(ws: list[torch.Tensor], h: torch.Tensor, schemes: list[QuantScheme], *,
                        damp: float = 0.01, block_size: int = 128, act_order: bool = False,
                        static_groups: bool = False, split: bool | None = None,
                        scales: list[Scales | None] | None = None, on_factored=None) -> list[QTensor]:
    """GPTQ of the weights that read one input (so share the Hessian h [K, K]): ws[i] [N_i, K]
    under schemes[i]. Returns each weight's QTensor, the same codes as gptq_quantize_weight gives
    each of them (its rows are independent: tests/algorithms/test_gptq.py checks it bit for bit).

    Weights with the same per-row scheme are solved as one concatenated weight (one column loop
    for q/k/v, one for gate/up). split (default: torch.distributed is active): a collective;
    every rank solves its share of each such job's rows (whole PANEL_ROWS panels, shares
    differing by one panel at most, so each rank gets about K x N / world of every job) and the
    pieces are broadcast, so that every rank returns all weights; the triangular inverse of the
    Hessian's factor is shared out the same way (_factor: column panels by cost). A weight whose scales are not
    per row (tensor / block strategy) is solved whole by rank (its index mod world).
    scales: one entry per weight, its fixed scales (see gptq_quantize_weight) or None; a weight
    with fixed scales has no dynamic groups, and it is concatenated only with weights that also
    have fixed scales (their scales concatenated along rows as round to nearest's are).
    on_factored: called once the Hessian's factor exists (gptq_handler times the phases)."""
    for w, s in zip(ws, schemes):
        _check(w, h, s, damp, block_size)
    if scales is None:
        scales = [None] * len(ws)
    if len(scales) != len(ws):
        raise ValueError(f"scales has {len(scales)} entries for {len(ws)} weights: give one (Scales or None) per weight")
    if split is None:
        split = distributed.active()
    world, me = (distributed.world_size(), distributed.rank()) if split else (1, 0)
    dev = ws[0].device
    fac = _factor(h, damp, act_order, dev, world, me)
    if on_factored is not None:
        on_factored()
    # jobs: runs of consecutive weights solved as one
    jobs: list[list[int]] = []
    for i, s in enumerate(schemes):
        if jobs and _mergeable(schemes[jobs[-1][-1]], s) and \
                (scales[jobs[-1][-1]] is None) == (scales[i] is None):
            jobs[-1].append(i)
        else:
            jobs.append([i])
    out: list[QTensor | None] = [None] * len(ws)
    for ji, job in enumerate(jobs):
        scheme = schemes[job[0]]
        fixed = scales[job[0]] is not None      # the same for every weight of the job
        dynamic_groups = scheme.strategy == "group" and not (act_order or static_groups or fixed)
        bs = -(-block_size // scheme.group_size) * scheme.group_size if dynamic_groups else block_size
        if world == 1 or (_row_split(scheme) and not scheme.two_level):
            for i, qt in zip(job, _solve_rows(ws, job, scheme, scales, fac, dynamic_groups, bs, world, me)):
                out[i] = qt
            continue
        # a weight whose scales are not per row, or with a tensor scale of its own (two-level):
        # solved whole by one rank, U and the scales broadcast, every rank stores the codes
        i = job[0]
        rtn = quantize(ws[i].detach().double().float(), scheme, pad=True, scales=scales[i])
        full = _scales_of(rtn)
        w64 = ws[i].detach().double()
        owner = ji % world
        U = _solve(w64, fac, scheme, full, dynamic_groups, bs, rtn.codes.shape[1]) if me == owner else \
            torch.empty(w64.shape, dtype=torch.float32, device=dev)
        for t in (U, *full[:3]):
            if t is not None:
                distributed.broadcast_(t, src=owner)
        out[i] = _finish(U, full, scheme)
    return out


_QFIELDS = ("codes", "scale", "zero_point", "scale_codes")


def _solve_rows(ws: list[torch.Tensor], job: list[int], scheme: QuantScheme, scales: list, fac: _Factor,
                dynamic_groups: bool, bs: int, world: int, me: int) -> list[QTensor]:
    """GPTQ of the weights ws[job] (one per-row scheme: solved as one concatenated weight), this
    rank's rows only: round to nearest's scales of those rows (per-row scales: the rows' values
    in the whole weight's), the column loop, the stored codes and their check (_finish); then
    every rank's codes and scales are broadcast (one byte per weight for integer and 8-bit
    codes) and every rank returns every weight's QTensor. With world == 1 the rows are all rows
    (any scheme, two-level included: its global scale from the whole weight). A collective when
    world > 1. The codes are those of solving each weight whole (rows are independent)."""
    sizes = [ws[i].shape[0] for i in job]
    starts = [sum(sizes[:k]) for k in range(len(job))]
    n, K, dev = sum(sizes), ws[job[0]].shape[1], ws[job[0]].device
    lo, hi = _rows_of(n, world, me) if world > 1 else (0, n)
    pieces = [(i, max(lo, st) - st, min(hi, st + m) - st) for i, st, m in zip(job, starts, sizes)
              if min(hi, st + m) > max(lo, st)]
    # round to nearest's scales of my rows (under the fixed scales where given)
    rtn = [quantize(ws[i][a:b].detach().double().float(), scheme, pad=True, scales=_row_scales(scales[i], a, b))
           for i, a, b in pieces]
    probe = rtn[0] if rtn else quantize(ws[job[0]][:1].detach().float(), scheme, pad=True,
                                        scales=_row_scales(scales[job[0]], 0, 1))
    kp = probe.codes.shape[1]
    full = {f: None if getattr(probe, f) is None else
            getattr(probe, f).new_empty((n,) + tuple(getattr(probe, f).shape[1:])) for f in _QFIELDS}
    gscale = probe.global_scale if world == 1 else None
    if hi > lo:
        mine = Scales(*(None if getattr(probe, f) is None else torch.cat([getattr(q, f) for q in rtn])
                        for f in _QFIELDS[1:]), gscale)
        del rtn
        w64 = torch.cat([ws[i][a:b].detach().double() for i, a, b in pieces])
        qt = _finish(_solve(w64, fac, scheme, mine, dynamic_groups, bs, kp), mine, scheme)
        del w64
        if world == 1:
            full = {f: getattr(qt, f) for f in _QFIELDS}
        else:
            for f in _QFIELDS:
                if full[f] is not None:
                    full[f][lo:hi] = getattr(qt, f)
        del qt
    for r in range(world if world > 1 else 0):     # every rank gets every rank's rows
        a, b = _rows_of(n, world, r)
        if b > a:
            for f in _QFIELDS:
                if full[f] is not None:
                    distributed.broadcast_(full[f][a:b], src=r)
    return [QTensor(*(None if full[f] is None else full[f][st:st + m] for f in _QFIELDS[:3]), scheme, (m, K),
                    None if full["scale_codes"] is None else full["scale_codes"][st:st + m], gscale)
            for st, m in zip(starts, sizes)]


def _row_scales(sc: Scales | None, a: int, b: int) -> Scales | None:
    """Rows [a, b) of per-row fixed scales (None stays None)."""
    return None if sc is None else Scales(*(None if t is None else t[a:b] for t in sc[:3]), sc.global_scale)


def gptq_quantize_weight(w: torch.Tensor, h: torch.Tensor, scheme: QuantScheme, *, damp: float = 0.01,
                         block_size: int = 128, act_order: bool = False, static_groups: bool = False,
                         scales: Scales | None = None) -> GPTQResult:
    """GPTQ of one weight (in this process, whether or not torch.distributed is active).

    w: [N, K] float weight (y = x @ w.T); h: [K, K] Hessian X^T X / n (HessianAccumulator).
    damp: fraction of mean(diag H) added to the diagonal before inverting (the paper's 1%).
    block_size: columns per lazy-update block (rounded up to a multiple of the group size for
      dynamic group scales, so that a group's scales see its columns' current values).
    act_order / static_groups: see the module docstring.
    scales: fixed scales for every group (e.g. lowbit.algorithms.scale_search's MSE-optimal ones; shapes of
      quantize(w, scheme, pad=True).scale) instead of round to nearest's; loss_rtn is then the loss
      of round to nearest under these scales.
    Returns the QTensor (padded along K when the group size does not divide K) and the losses.
    Columns that no calibration input reaches (H_jj = 0) get H_jj = 1: they are rounded to
    nearest and receive no compensation.
    """
    qt = gptq_quantize_group([w], h, [scheme], damp=damp, block_size=block_size, act_order=act_order,
                             static_groups=static_groups, split=False, scales=[scales])[0]
    w64 = w.detach().double()
    h = h.double().to(w.device)
    rtn = quantize(w64.float(), scheme, pad=True, scales=scales)
    return GPTQResult(qt, output_loss(w64, qt.dequantize(torch.float64), h),
                      output_loss(w64, rtn.dequantize(torch.float64), h))


@torch.no_grad()
def gptq_model(model: torch.nn.Module, recipe, calib, *, ignore=None, overrides=None, act_static_scales=None,
               damp: float = 0.1, block_size: int = 128, act_order: bool = True, static_groups: bool = False,
               holdout: int = 4, backend: str = "auto", progress: bool = False, mse: bool = False,
               targets: str = "quantized"):
    """quantize_model with GPTQ weights: the same plan (recipe, ignore, overrides; lm_head and tied
    Linears stay float), each Linear replaced in execution order by a QuantLinear whose weight GPTQ
    chose on the inputs that the already-quantized model feeds it (lowbit.algorithms.sequential).
    calib: input-id tensors [B, T] or dicts of model kwargs.

    holdout: every holdout-th calibration token is kept out of the Hessian and used to validate:
    a layer whose GPTQ weight has a larger output loss than round-to-nearest's on those tokens
    keeps the round-to-nearest codes (GPTQ over-fits when the tokens are few for K, e.g. a
    down_proj with K = 1536 on 2,048 tokens). 0 disables the check. The defaults (damp 0.1,
    act_order, holdout 4) are what measured best on SmolLM2 (docs/perplexity.md).
    mse: the fixed scales come from lowbit.algorithms.scale_search (MSE-optimal range per scale, weighted by
    the Hessian's diagonal) instead of round to nearest's; the held-out fallback uses them too.
    Every decision's `reason` gains the layer's loss relative to round-to-nearest and the choice.
    targets: "quantized" (each layer fits its own float weight on its quantized-model inputs) or
    "float" (each layer fits the FLOAT model's outputs: lowbit.algorithms.gptq.asym).
    Returns the QuantSummary; on error the model is left as it was."""
    from lowbit.recipes.plan import plan
    from lowbit.algorithms.sequential import calibrate_sequentially
    summary = plan(model, recipe, ignore, overrides)
    handle = gptq_handler(model, summary, act_static_scales, damp=damp, block_size=block_size, act_order=act_order,
                          static_groups=static_groups, holdout=holdout, backend=backend, mse=mse)
    if targets not in ("quantized", "float"):
        raise ValueError(f"targets={targets!r}: choose 'quantized' (plain GPTQ) or 'float' (the float model's outputs)")
    if targets == "float":
        from lowbit.algorithms.gptq.asym import float_target_handler
        calib = list(calib)
        handle = float_target_handler(model, [d.name for d in summary.quantized], calib, handle, damp=damp,
                                      holdout=holdout)
    calibrate_sequentially(model, [d.name for d in summary.quantized], calib, handle, progress=progress,
                           desc=f"GPTQ {summary.recipe}")
    summary.method = "gptq"
    return summary


def gptq_handler(model: torch.nn.Module, summary, act_static_scales=None, *, damp: float = 0.1,
                 block_size: int = 128, act_order: bool = True, static_groups: bool = False, holdout: int = 4,
                 backend: str = "auto", mse: bool = False, host_twin: bool = True):
    """The lowbit.algorithms.sequential handler that replaces a group of Linears sharing one input by their
    GPTQ QuantLinears (gptq_model's options; `summary` from lowbit.recipes.plan.plan). Used by
    gptq_model on a whole model and by lowbit.pipelines.layerwise one decoder layer at a time.
    host_twin: QuantLinear's (4-bit codes' exact twin on the host, or left on the device, where
    lowbit.pipelines.layerwise packs them for the checkpoint without the host copy of every code)."""
    from lowbit.nn.quant_linear import QuantLinear
    from lowbit.recipes.plan import layer_act
    if holdout < 0 or holdout == 1:
        raise ValueError(f"holdout={holdout}: give 0 (no validation) or n >= 2 (every n-th token validates)")
    decisions = {d.name: d for d in summary.quantized}

    def weights(n, qt, sc):
        """The float64 weight [N, K] and the dequantized GPTQ and round-to-nearest weights (round
        to nearest under the fixed scales sc where given)."""
        d, lin = decisions[n], model.get_submodule(n)
        w = lin.weight.detach()
        w64 = w.double() if w.dtype != torch.float64 else w
        rtn = quantize(w64.float(), summary.recipe_of(d).weight, pad=True, scales=sc)
        return w64, qt.dequantize(torch.float64), rtn.dequantize(torch.float64)


    timings = {"hessian": 0.0, "factor": 0.0, "solve": 0.0, "losses": 0.0, "build": 0.0}
    clock = [0.0]

    def lap(phase, dev):     # seconds per phase (device queue drained), read by layerwise's summary
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        now = time.time()
        if phase is not None:
            timings[phase] += now - clock[0]
        clock[0] = now

    def hessian(inputs, K):
        """X^T X / n of the fit tokens (all but every holdout-th), all ranks' (a collective): the
        batches' products accumulated in chunks (HessianAccumulator with counts: no K x K term per
        batch; ranks > 0 hold a few chunk sums). The accumulator is dropped on return: only H
        stays alive."""
        acc = HessianAccumulator(K, counts=distributed.counts(len(inputs)))
        for x in inputs:
            acc.add(_fit_rows(x.reshape(-1, K), holdout))
        acc.reduce()      # a collective: every rank, same order
        return acc.hessian()

    def handle(names, inputs):
        K = model.get_submodule(names[0]).in_features
        dev = model.get_submodule(names[0]).weight.device
        lap(None, dev)
        h = hessian(inputs, K)
        lap("hessian", dev)
        lins = [model.get_submodule(n) for n in names]
        schemes = [summary.recipe_of(decisions[n]).weight for n in names]
        scs = [None] * len(names)
        if mse:     # fixed scales: MSE-optimal, weighted by the fit Hessian's diagonal (every rank alike)
            from lowbit.algorithms.scale_search import search_scales
            scs = [search_scales(lin.weight.detach(), s, hdiag=torch.diagonal(h)) for lin, s in zip(lins, schemes)]
        # One column loop per run of Linears with the same scheme (q/k/v, gate/up concatenated);
        # under torch.distributed each rank solves its share of the rows and every rank ends
        # with every weight (gptq_quantize_group).
        try:
            qts = gptq_quantize_group([lin.weight for lin in lins], h, schemes, damp=damp, block_size=block_size,
                                      act_order=act_order, static_groups=static_groups, scales=scs,
                                      on_factored=lambda: lap("factor", dev))
        except ValueError as err:
            shapes = ", ".join(f"{n} {list(decisions[n].shape)}" for n in names)
            raise ValueError(f"GPTQ of layer(s) {shapes}: {err}") from err
        lap("solve", dev)
        world, me = distributed.world_size(), distributed.rank()
        # W - Q of GPTQ's and of round to nearest's weight, for every Linear of the group
        ds = []
        for n, qt, sc in zip(names, qts, scs):
            w64, qg, qr = weights(n, qt, sc)
            ds += [w64 - qg, w64 - qr]
            del w64, qg, qr
        # The choice, GPTQ or round to nearest, on the held-out tokens: their output errors from
        # the tokens themselves, each rank on its batches, summed in batch order (no held-out
        # Hessian: no second K x K matrix, no second ordered chain of them, ~30% fewer flops
        # for a Llama-8B layer than building it and multiplying by it).
        hv = held_out_losses(inputs, holdout, ds) if holdout else None
        # The report: the losses on the fit tokens, tr(D H D^T), by row panels shared out over
        # the ranks (every rank a share of every Linear's [N, K] x [K, K] product: balanced
        # whatever the Linears' sizes), the panels' values added exactly on every rank.
        hd = h.to(lins[0].weight.device)
        fit = [panel_losses(d, hd, world, me) for d in ds]
        del ds
        infos = []
        for i in range(len(names)):
            lq, l0 = fit[2 * i], fit[2 * i + 1]
            info = [lq / l0 if l0 > 0 else 1.0, math.nan, 0.0]
            if hv is not None:
                lv, lr = float(hv[2 * i]), float(hv[2 * i + 1])
                info[1:] = [lv / lr if lr > 0 else 1.0, float(lv > lr)]
            infos.append(info)
        lap("losses", dev)
        out = {}
        for i, n in enumerate(names):
            d, lin, r = decisions[n], lins[i], summary.recipe_of(decisions[n])
            info = infos[i]
            qt = qts[i]
            if info[2]:
                qt = quantize(lin.weight.detach().float(), r.weight, pad=True, scales=scs[i])
            d.reason += f"; GPTQ output loss {float(info[0]):.3f}x round-to-nearest's"
            if not math.isnan(float(info[1])):
                d.reason += f", {float(info[1]):.3f}x on held-out tokens"
                if info[2]:
                    d.reason += ": kept round-to-nearest"
            act, scale = layer_act(d, r, act_static_scales)
            bias = None if lin.bias is None else lin.bias.detach().float()
            out[n] = QuantLinear(qt, r.weight, act, bias=bias, act_static_scale=scale,
                                 backend=backend, host_twin=host_twin).to(lin.weight.device)
        lap("build", dev)
        return out

    handle.timings = timings
    return handle
