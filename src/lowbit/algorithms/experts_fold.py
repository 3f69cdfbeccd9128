"""AWQ and SmoothQuant for the routed experts of MoE models, on the one side where a per-channel
fold is exact: each expert's down_proj.

Expert e's down_proj reads a_e = act(gate_e x) * up_e x, which is linear in up_e's output rows:
scaling up_e's row j (and its bias) by 1 / s_j and down_e's column j by s_j leaves the expert's
output unchanged (up to float rounding), per expert, with no other reader of those rows. So each
expert gets its own factor s_e [I]:
- AWQ (awq_experts): searched as lowbit.algorithms.awq searches a dense fold group (s(alpha) =
  mean|a_j|^alpha normalised, the alpha of the grid with the smallest output loss
  tr((W - Q(W s)/s) H (W - Q(W s)/s)^T), H from the tokens routed to e; alpha = 0 is s = 1);
- SmoothQuant (smooth_experts): s_j = max|a_j|^alpha / max|W_:,j|^(1 - alpha), the formula of
  lowbit.algorithms.smoothquant, with the maximum over e's routed tokens.
The gate_up side has no exact fold (lowbit.algorithms.smoothquant.refuse_experts says why) and is
left as it is; gpt-oss's activation clamps up ((clamp(up) + 1) * ...): not linear in up, refused.

Statistics: one forward pass of the float model over the calibration batches, each experts module's
own call arguments captured (the router's choice per token). The folds are exact, so the inputs
of later layers are those of the float model; no sequential pass is needed. An expert with fewer
than `min_tokens` routed tokens keeps s = 1 (listed in the result, like GPTQ's rule). Under
torch.distributed (each rank holding its share of the batches) the token counts are summed, the
SmoothQuant maxima taken, and AWQ's sums added in batch order over the ranks: every rank folds
the factors one process with all batches folds.
"""
from __future__ import annotations

import torch

from lowbit.algorithms import distributed
from lowbit.algorithms.awq import GRID, search_scale
from lowbit.algorithms.gptq.options import MIN_TOKENS
from lowbit.algorithms.smoothquant import smoothing_factors
from lowbit.archs.decoders import UnsupportedArchitecture
from lowbit.archs.experts import find_experts
from lowbit.archs.forward import run_batches
from lowbit.ops.grouped import sort_tokens
from lowbit.recipes.presets import get_recipe


def _up_rows(spec, I: int) -> torch.Tensor:
    """Indices of the up rows in the fused gate_up output [2I]."""
    return torch.arange(I, 2 * I) if spec.glu_split == "chunk" else torch.arange(1, 2 * I, 2)


def _capture(model, names: list[str], batches) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    got = {n: [] for n in names}

    def make(n):
        def pre(m, a, kw):
            args = list(a) + list(kw.values())          # (hidden_states, top_k_index, top_k_weights)
            got[n].append((args[0].detach(), args[1].detach()))
        return pre
    hooks = [model.get_submodule(n).register_forward_pre_hook(make(n), with_kwargs=True) for n in names]
    run_batches(model, batches, hooks)
    return got


def _down_inputs(model, calib, what: str):
    """{experts name: (spec, per expert: list of its down inputs [m, I] float64 per batch,
    routed tokens per expert, all ranks')} from the float model; the refusals of the module docstring."""
    found = find_experts(model)
    if not found:
        raise ValueError(f"{type(model).__name__} has no fused MoE experts: use lowbit.algorithms.awq / smoothquant")
    bad = [n for n, s in found.items() if s.activation != "act_fn"]
    if bad:
        raise UnsupportedArchitecture(f"{what} of the experts' down side on {found[bad[0]].family} ({bad[0]}, ...): "
                                      "its activation clamps up ((clamp(up) + 1) * ...), so scaling up's rows does "
                                      f"not fold exactly; quantize without {what}")
    calib = list(calib)
    if not calib:
        raise ValueError(f"{what} needs at least one calibration batch")
    inputs = _capture(model, list(found), calib)
    out = {}
    for n, spec in found.items():
        mod = model.get_submodule(n)
        gu = getattr(mod, spec.gate_up)
        E, I = gu.shape[0], getattr(mod, spec.down).shape[2 if spec.layout == "enk" else 1]
        up = _up_rows(spec, I)
        bias = getattr(mod, spec.gate_up_bias) if spec.gate_up_bias else None
        acts, tokens = [[] for _ in range(E)], [0] * E
        for x, idx in inputs[n]:
            x = x.reshape(-1, x.shape[-1])
            rt = sort_tokens(idx, E)
            for e in range(E):
                rows = rt.token[int(rt.offsets[e]):int(rt.offsets[e + 1])]
                tokens[e] += int(rows.numel())
                if rows.numel():
                    w = gu[e] if spec.layout == "enk" else gu[e].T      # [2I, H]
                    h = x[rows].double() @ w.double().T + (0 if bias is None else bias[e].double())
                    acts[e].append(mod.act_fn(h[:, up - 1] if spec.glu_split == "interleave" else h[:, :I]) * h[:, up])
        out[n] = (spec, acts, distributed.all_sum(torch.tensor(tokens, dtype=torch.int64)).tolist())
    return out


def _down_weight(mod, spec, e: int) -> torch.Tensor:
    """Expert e's down weight as [H, I] (out, in)."""
    dn = getattr(mod, spec.down)
    return dn[e] if spec.layout == "enk" else dn[e].T


def _fold(mod, spec, e: int, s: torch.Tensor) -> None:
    """up rows of expert e (and their bias) / s, down columns * s, in place."""
    gu, dn = getattr(mod, spec.gate_up), getattr(mod, spec.down)
    s = s.to(gu.dtype)
    up = _up_rows(spec, s.shape[0])
    if spec.layout == "enk":
        gu[e, up, :] /= s[:, None]
        dn[e] *= s[None, :]
    else:
        gu[e][:, up] /= s[None, :]
        dn[e] *= s[:, None]
    if spec.gate_up_bias:
        getattr(mod, spec.gate_up_bias)[e, up] /= s


@torch.no_grad()
def awq_experts(model: torch.nn.Module, recipe, calib, *, grid=GRID, min_tokens: int = MIN_TOKENS
                ) -> dict[str, dict]:
    """Search and fold per-expert AWQ factors into the down side of every experts module of
    `model` (float, in place) for the weight scheme of `recipe` (weight-only). calib: input-id
    tensors [B, T] or dicts. Returns {experts module: {"alpha": [per expert, None: kept s = 1 for
    lack of tokens], "tokens": [routed tokens per expert]}}. ValueError for a recipe that
    quantizes activations or a model without experts; UnsupportedArchitecture for gpt-oss."""
    r = get_recipe(recipe)
    if r.act is not None:
        raise ValueError(f"AWQ is for weight-only recipes; {r.name} also quantizes activations (use SmoothQuant: "
                         "smooth_experts)")
    out = {}
    for n, (spec, acts, tokens) in _down_inputs(model, calib, "AWQ").items():
        mod, alphas = model.get_submodule(n), []
        for e in range(len(tokens)):
            if tokens[e] < min_tokens:
                alphas.append(None)
                continue
            s, alpha, _ = search_scale([_down_weight(mod, spec, e).detach()], acts[e], r.weight, grid)
            _fold(mod, spec, e, s)
            alphas.append(alpha)
        out[n] = {"alpha": alphas, "tokens": tokens}
    return out


@torch.no_grad()
def smooth_experts(model: torch.nn.Module, calib, alpha: float = 0.5, *, min_tokens: int = MIN_TOKENS
                   ) -> dict[str, dict]:
    """Fold per-expert SmoothQuant factors into the down side of every experts module of `model`
    (float, in place). Returns {experts module: {"s": [per expert: s [I], None when kept s = 1
    for lack of tokens], "tokens": [...]}}. Refusals as awq_experts."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha} must be in [0, 1]")
    out = {}
    for n, (spec, acts, tokens) in _down_inputs(model, calib, "SmoothQuant").items():
        mod, ss = model.get_submodule(n), []
        for e in range(len(tokens)):
            if tokens[e] < min_tokens:
                ss.append(None)
                continue
            I = _down_weight(mod, spec, e).shape[1]
            mine = torch.stack([a.abs().amax(dim=0) for a in acts[e]]).amax(dim=0) if acts[e] else \
                torch.zeros(I, dtype=torch.float64, device=_down_weight(mod, spec, e).device)
            amax = distributed.all_max(mine).float()          # a collective: every rank, same experts
            s = smoothing_factors(amax, [_down_weight(mod, spec, e)], alpha)
            _fold(mod, spec, e, s)
            ss.append(s)
        out[n] = {"s": ss, "tokens": tokens}
    return out
