"""Named kernel bugs, each simulated exactly: the output a kernel with that bug would produce.

Every hypothesis is a small edit of what the reference computes (a scale read from the wrong
place, a K range dropped, codes decoded with the wrong format, ...) whose output is computed in
float64, together with the implementation gate of the EDITED computation (a kernel with the bug
still rounds like a kernel). diagnose.py names a bug only when its simulation reproduces the
kernel's output within that gate everywhere.

Each generator takes a Sim and yields Hyp objects lazily; the ones that do not apply to the
operands (no zero point, no bias, an 8-bit format for a nibble bug, ...) yield nothing.
Real bug reports behind the hypotheses are cited next to them and in tests/verify/test_diagnose_zoo.py.
"""
from __future__ import annotations

from lowbit.verify import bugs_codes as bc
from lowbit.verify import bugs_output as bo
from lowbit.verify import bugs_rounding as br
from lowbit.verify import bugs_scales as bs
from lowbit.verify.simulate import Hyp, Sim, explained  # noqa: F401  (the catalogue's vocabulary)

# Most specific first: where two simulations coincide, the earlier one names the group.
ALL = (bo.permutation_hypotheses, bs.scale_value_hypotheses, bs.scale_layout_hypotheses,
       bs.both_sides_hoisted, bs.silent_fallback_hypotheses, bs.scale_axis_hypotheses, bs.scale_permutation_hypotheses,
       bs.mx_layout_hypotheses, bc.code_hypotheses, br.wrapped_code_hypotheses, br.stale_scale_wrap_hypotheses,
       br.rounding_rule_hypotheses,
       br.scale_rule_hypotheses,
       bc.transpose_hypotheses, bo.k_range_hypotheses, bo.bias_hypotheses, bo.output_hypotheses,
       bo.precision_hypotheses, bo.half_operand_hypotheses, bo.offset_hypotheses, br.stochastic_rounding_hypotheses,
       bs.constant_scale_hypotheses, bs.constant_factor_hypothesis)


def all_hypotheses(sim: Sim):
    """Every applicable hypothesis, lazily, most specific first."""
    for gen in ALL:
        for h in gen(sim):
            if h is not None:
                yield h
