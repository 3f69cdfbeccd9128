"""File formats only (no model code): st_format (the one safetensors header parser and the sharded
writer), qtensor_file (lowbit's own QTensor files: safetensors + validated metadata), ct_layout (a
Linear's compressed-tensors tensors), outdir (output directories lowbit may rewrite). Model
checkpoints are written and read by lowbit.pipelines.checkpoint. Nothing here pickles."""
