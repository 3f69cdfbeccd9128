"""GPTQ's factor of one Hessian: damping, the act-order permutation and the upper Cholesky factor of
H^-1, computed on fixed column panels so that every rank count gives the same bits."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.algorithms import distributed


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
