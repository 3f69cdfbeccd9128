"""W4A16 (4-bit weights, bf16 / fp16 activations) by idea: layout (how prepare_w4 lays the
weights out), configs (kernel choice and tiles per M), launch (the launchers). The public face
is lowbit.ops.weight_only."""
