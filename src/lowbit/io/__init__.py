"""Checkpoints. qtensor_file: lowbit's own QTensor files (safetensors + validated metadata);
compressed_tensors / st_format / sharded: model checkpoints. Nothing here pickles."""
