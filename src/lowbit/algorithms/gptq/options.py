"""GPTQOptions: the settings of GPTQ on a model (gptq_model, gptq_handler, gptq_experts), typed and
checked in one place."""
from __future__ import annotations

from dataclasses import dataclass

from lowbit.options import Options

# An expert with fewer routed calibration tokens keeps round to nearest's codes
# (lowbit.algorithms.gptq.experts' module docstring says why).
MIN_TOKENS = 32
TARGETS = ("quantized", "float")


@dataclass(frozen=True)
class GPTQOptions(Options):
    """How GPTQ quantizes a model's Linears and experts.

    damp:          the ridge added to the Hessian's diagonal, as a fraction of its mean.
    block_size:    columns per block of the column loop (the lazy batch updates).
    act_order:     quantize the columns in order of decreasing Hessian diagonal.
    static_groups: with act_order, fix every group's scales from the whole weight first.
    holdout:       every holdout-th calibration token is kept out of the Hessian and validates: a
                   layer whose GPTQ weight has a larger output loss than round to nearest's on those
                   tokens keeps round to nearest's codes. 0 disables the check.
    backend:       the QuantLinear / QuantExperts backend of the modules built.
    mse:           the fixed scales come from lowbit.algorithms.scale_search (MSE-optimal range per
                   scale, weighted by the Hessian's diagonal) instead of round to nearest's.
    min_tokens:    experts with fewer routed tokens keep round to nearest (None: MIN_TOKENS).
    targets:       "quantized" (each layer fits its own float weight on its quantized-model inputs)
                   or "float" (each layer fits the float model's outputs: lowbit.algorithms.gptq.asym;
                   gptq_model only).
    The defaults (damp 0.1, act_order, holdout 4) are what measured best on SmolLM2 (docs/perplexity.md)."""
    damp: float = 0.1
    block_size: int = 128
    act_order: bool = True
    static_groups: bool = False
    holdout: int = 4
    backend: str = "auto"
    mse: bool = False
    min_tokens: int | None = MIN_TOKENS
    targets: str = "quantized"

    def __post_init__(self):
        if self.holdout < 0 or self.holdout == 1:
            raise ValueError(f"holdout={self.holdout}: give 0 (no validation) or n >= 2 (every n-th token validates)")
        if self.targets not in TARGETS:
            raise ValueError(f"targets={self.targets!r}: choose 'quantized' (plain GPTQ) or 'float' (the float "
                             "model's outputs)")
        if self.min_tokens is None:
            object.__setattr__(self, "min_tokens", MIN_TOKENS)
        if self.min_tokens < 1:
            raise ValueError(f"min_tokens={self.min_tokens} must be >= 1 (experts with fewer routed tokens keep "
                             "round to nearest's codes)")
