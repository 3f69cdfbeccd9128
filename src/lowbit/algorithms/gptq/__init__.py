"""GPTQ (Frantar et al., 2022), split by idea: hessian (input statistics, losses, the held-out check),
factor (H^-1's Cholesky factor), solver (the column loop and the group solver: solver's docstring has
the method), block (the column loop as one Triton kernel), model (whole-model orchestration), options (GPTQOptions, the settings), asym
(targets the float model's outputs). The names below are the package's public face."""
from lowbit.algorithms.gptq.hessian import HessianAccumulator, held_out_losses, output_loss, panel_losses  # noqa: F401
from lowbit.algorithms.gptq.model import gptq_handler, gptq_model  # noqa: F401
from lowbit.algorithms.gptq.options import GPTQOptions  # noqa: F401
from lowbit.algorithms.gptq.solver import GPTQResult, gptq_quantize_group, gptq_quantize_weight  # noqa: F401
