"""Hadamard rotation of a pre-norm decoder's residual stream (QuaRot-style, no training), folded
exactly into the weights, so the rotated model is an ordinary float model of the same
architecture that any loader reads.

For an orthogonal Q [d, d] (a Hadamard matrix times random signs, / sqrt(d)) the residual
stream r is replaced by r Q:
    embeddings        E      -> E Q
    readers (q/k/v, gate/up, lm_head): W -> W Q        (y = r W^T = (r Q)(W Q)^T)
    writers (o_proj, down_proj):       W -> Q^T W      (their output is added to r)
RMSNorm commutes with Q only when its gain is 1 (rms(r Q) = rms(r), since ||r Q|| = ||r||), so
every norm gain is first absorbed into the readers' columns (W -> W diag(g), g -> 1), the final
norm into lm_head. lm_head then differs from the embedding: a tied lm_head is untied (the
checkpoint's config says tie_word_embeddings=false; lm_head stays in high precision).
Outlier channels of the residual stream are spread over all d channels, which is what per-token
activation quantization and per-group weight quantization want.

Not done here: the online Hadamard of QuaRot on the down_proj input (act(gate) * up has no linear
op in front to fold into; a loader would have to apply it at run time).
"""
from __future__ import annotations

import torch


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


def _decoder_parts(model):
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    need = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
    if layers is None or not all(all(hasattr(l, a) for a in need) for l in layers) or \
            not hasattr(inner, "embed_tokens") or not hasattr(inner, "norm") or not hasattr(model, "lm_head"):
        raise ValueError(f"rotation needs a pre-norm decoder (model.model.layers[i].input_layernorm / "
                         f"post_attention_layernorm / self_attn / mlp, model.model.norm, lm_head); "
                         f"{type(model).__name__} is not one (post-norm encoders have no exact fold)")
    for l in layers:
        for n in ("input_layernorm", "post_attention_layernorm"):
            if getattr(getattr(l, n), "bias", None) is not None:
                raise ValueError(f"rotation folds RMSNorm gains; {n} has a bias (LayerNorm): not supported")
    return inner, layers


def _scale_cols(lin: torch.nn.Linear, g: torch.Tensor) -> None:
    lin.weight.copy_((lin.weight.double() * g.double()[None, :]).to(lin.weight.dtype))


@torch.no_grad()
def rotate_model(model: torch.nn.Module, seed: int = 0) -> torch.Tensor:
    """Absorb norm gains and rotate the residual stream of a Llama-style decoder in place by a
    random Hadamard Q (seeded: the same seed gives the same model). Run it before SmoothQuant /
    GPTQ / quantize_model. Returns Q (float64 [d, d])."""
    inner, layers = _decoder_parts(model)
    d = inner.embed_tokens.weight.shape[1]
    Q = random_hadamard(d, torch.Generator().manual_seed(seed))
    Qf = lambda w: w.to(torch.float64)  # noqa: E731
    if model.lm_head.weight is inner.embed_tokens.weight or \
            model.lm_head.weight.data_ptr() == inner.embed_tokens.weight.data_ptr():
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone(), requires_grad=False)
        if getattr(model, "config", None) is not None:
            model.config.tie_word_embeddings = False
            getattr(model.config, "get_text_config", lambda: model.config)().tie_word_embeddings = False
    for l in layers:
        a, m = l.self_attn, l.mlp
        for norm, readers in ((l.input_layernorm, (a.q_proj, a.k_proj, a.v_proj)),
                              (l.post_attention_layernorm, (m.gate_proj, m.up_proj))):
            for r in readers:
                _scale_cols(r, norm.weight)
            norm.weight.fill_(1.0)
    _scale_cols(model.lm_head, inner.norm.weight)
    inner.norm.weight.fill_(1.0)
    e = inner.embed_tokens.weight
    e.copy_((Qf(e) @ Q).to(e.dtype))
    for l in layers:
        a, m = l.self_attn, l.mlp
        for r in (a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj):
            r.weight.copy_((Qf(r.weight) @ Q).to(r.weight.dtype))
        for w in (a.o_proj, m.down_proj):
            w.weight.copy_((Q.T @ Qf(w.weight)).to(w.weight.dtype))
            if w.bias is not None:
                w.bias.copy_((Qf(w.bias) @ Q).to(w.bias.dtype))
    model.lm_head.weight.copy_((Qf(model.lm_head.weight) @ Q).to(model.lm_head.weight.dtype))
    return Q
