"""Hadamard rotation of a pre-norm decoder's residual stream (QuaRot-style, no training), folded
exactly into the weights, so the rotated model is an ordinary float model of the same
architecture that any loader reads.

For an orthogonal Q [d, d] (a Hadamard matrix times random signs, / sqrt(d)) the residual
stream r is replaced by r Q:
    embeddings        E      -> E Q
    readers (q/k/v, gate/up, lm_head): W -> W Q        (y = r W^T = (r Q)(W Q)^T)
    writers (o_proj, down_proj):       W -> Q^T W      (their output is added to r)
RMSNorm commutes with Q only when its gain is 1 (rms(r Q) = rms(r), since ||r Q|| = ||r||), so
every norm gain is first absorbed into the readers' columns (W -> W diag(g), g -> 1; a Gemma-style
gain 1 + w likewise, w -> 0), the final norm into lm_head. Which norm feeds which readers and which
Linears write the stream come from lowbit.archs.decoders. Refused (not exact): post-norms on a
branch's output (Gemma 2/3, OLMo 2: the gain applies after the normalization, no Linear can take
it) and LayerNorm (Cohere: the mean subtraction does not commute with Q). lm_head then differs
from the embedding: a tied lm_head is untied (the checkpoint's config says
tie_word_embeddings=false; lm_head stays in high precision).
Outlier channels of the residual stream are spread over all d channels, which is what per-token
activation quantization and per-group weight quantization want.

Not done here: the online Hadamard of QuaRot on the down_proj input (act(gate) * up has no linear
op in front to fold into; a loader would have to apply it at run time).
"""
from __future__ import annotations

import torch

from lowbit.archs.decoders import UnsupportedArchitecture, decoder_for


def _paley(q: int) -> torch.Tensor:
    """Paley construction I: a Hadamard matrix of order q + 1 for a prime q = 3 (mod 4)."""
    res = torch.zeros(q, dtype=torch.float64)
    for x in range(1, q):
        res[x * x % q] = 1
    chi = lambda a: 0.0 if a % q == 0 else (1.0 if res[a % q] else -1.0)  # noqa: E731
    Qm = torch.tensor([[chi(j - i) for j in range(q)] for i in range(q)], dtype=torch.float64)
    S = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    S[0, 1:], S[1:, 0], S[1:, 1:] = 1, -1, Qm
    return S + torch.eye(q + 1, dtype=torch.float64)


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % p for p in range(2, int(n ** 0.5) + 1))


def hadamard(n: int) -> torch.Tensor:
    """A Hadamard matrix of order n (entries +-1, H H^T = n I), float64 [n, n]: Sylvester for
    powers of two, Kronecker products with Paley matrices (orders q + 1, q prime = 3 mod 4) for
    the rest (576 = 12 * 12 * 4, 1536 = 12 * 128). ValueError when no such product exists."""
    if n == 1:
        return torch.ones(1, 1, dtype=torch.float64)
    if n % 2 == 0 and (n & (n - 1)) == 0:
        h = hadamard(n // 2)
        return torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    for m in range(n, 2, -1):
        if n % m == 0 and m % 4 == 0 and _is_prime(m - 1) and (m - 1) % 4 == 3:
            try:
                return torch.kron(_paley(m - 1), hadamard(n // m))
            except ValueError:
                continue
    raise ValueError(f"no Hadamard matrix of order {n} from Sylvester/Paley products; rotation needs a "
                     "hidden size such as 2^k, 12 * 2^k, 20 * 2^k, ...")


def random_hadamard(n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Orthogonal Q = H diag(+-1) / sqrt(n), float64 [n, n]."""
    signs = torch.randint(0, 2, (n,), generator=generator, dtype=torch.float64) * 2 - 1
    return hadamard(n) * signs[None, :] / n ** 0.5


def _plan(model):
    """The family entry, its decoder layers and the model-level modules; UnsupportedArchitecture
    where the rotation would not be exact."""
    d = decoder_for(model)
    why = []
    if d.post_norms:
        why.append(f"{', '.join(d.post_norms)} normalize a branch's output before it joins the residual "
                   "stream; their gain multiplies after the normalization, so it can be absorbed into no "
                   "Linear and the rotated stream would be scaled channel by channel")
    if d.norm != "rms":
        why.append("its LayerNorm subtracts the channel mean, which does not commute with a rotation")
    if why:
        raise UnsupportedArchitecture(f"rotation is not exact for {d.family}: " + "; ".join(why))
    try:
        inner = {k: model.get_submodule(getattr(d, k)) for k in ("embed", "final_norm", "lm_head")}
        layers = model.get_submodule(d.layers)
    except AttributeError as err:
        raise UnsupportedArchitecture(f"rotation needs the {d.family} causal LM ({d.layers}, {d.embed}, "
                                      f"{d.final_norm}, {d.lm_head}); {type(model).__name__}: {err}") from None
    if getattr(inner["final_norm"], "bias", None) is not None:
        raise UnsupportedArchitecture(f"{d.family}: {d.final_norm} has a bias; rotation folds gains only")
    return d, layers, inner


def _scale_cols(lin: torch.nn.Linear, g: torch.Tensor) -> None:
    lin.weight.copy_((lin.weight.double() * g.double()[None, :]).to(lin.weight.dtype))


def _absorb(norm: torch.nn.Module, readers, offset: float) -> None:
    """Move the gain offset + w into the readers' columns and leave the norm with gain 1."""
    g = norm.weight.double() + offset
    for r in readers:
        _scale_cols(r, g)
    norm.weight.fill_(1.0 - offset)


@torch.no_grad()
def rotate_model(model: torch.nn.Module, seed: int = 0, q: torch.Tensor | None = None) -> torch.Tensor:
    """Absorb norm gains and rotate the residual stream of a decoder in place by a random Hadamard
    Q (seeded: the same seed gives the same model). The family's layout comes from
    lowbit.archs.decoders; families where the rotation cannot be exact (post-norms, LayerNorm) are
    refused with the reason. Run it before SmoothQuant / GPTQ / quantize_model. q: an orthogonal
    float64 [d, d] to use instead (the identity absorbs the gains alone). Returns Q (float64 [d, d])."""
    d, layers, inner = _plan(model)
    embed, final, head = inner["embed"], inner["final_norm"], inner["lm_head"]
    dim = embed.weight.shape[1]
    Q = random_hadamard(dim, torch.Generator().manual_seed(seed)) if q is None else q.to(torch.float64)
    if Q.shape != (dim, dim) or not torch.allclose(Q @ Q.T, torch.eye(dim, dtype=torch.float64), atol=dim * 2.0 ** -40):
        raise ValueError(f"q must be an orthogonal [{dim}, {dim}] matrix (Q Q^T = I); got shape {tuple(Q.shape)}")
    Qf = lambda w: w.to(torch.float64)  # noqa: E731
    if head.weight is embed.weight or head.weight.data_ptr() == embed.weight.data_ptr():
        head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
        if getattr(model, "config", None) is not None:
            model.config.tie_word_embeddings = False
            getattr(model.config, "get_text_config", lambda: model.config)().tie_word_embeddings = False
    sub = lambda l, names: [l.get_submodule(n) for n in names]  # noqa: E731
    for l in layers:
        for f in d.feeds:
            _absorb(l.get_submodule(f.norm), sub(l, f.linears), d.gain_offset)
    _absorb(final, [head], d.gain_offset)
    e = embed.weight
    e.copy_((Qf(e) @ Q).to(e.dtype))
    for l in layers:
        for r in sub(l, d.readers()):
            r.weight.copy_((Qf(r.weight) @ Q).to(r.weight.dtype))
        for w in sub(l, d.writers):
            w.weight.copy_((Q.T @ Qf(w.weight)).to(w.weight.dtype))
            if w.bias is not None:
                w.bias.copy_((Qf(w.bias) @ Q).to(w.bias.dtype))
    head.weight.copy_((Qf(head.weight) @ Q).to(head.weight.dtype))
    return Q
