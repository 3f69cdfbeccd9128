"""Write a tiny random-weight Llama checkpoint quantized by a lowbit recipe, for `lowbit verify-model`
on a machine without a model download (a GPU box): quantize_model + save_compressed, as
`lowbit quantize` writes them.

    python scripts/tiny_checkpoint.py OUT_DIR [RECIPE] [--kv-cache fp8-head]
"""
import argparse

import torch
import transformers

from lowbit.pipelines.checkpoint import save_compressed
from lowbit.pipelines.quantize_model import quantize_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("recipe", nargs="?", default="w8a8-int8")
    p.add_argument("--kv-cache", default=None, help="e.g. fp8-head (static scales calibrated on random ids)")
    a = p.parse_args()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    kw = {}
    if a.kv_cache:
        kw = {"kv_cache": a.kv_cache, "kv_calib": [torch.randint(0, 256, (2, 32))]}
    quantize_model(model, a.recipe, **kw)
    print(save_compressed(model, a.out, a.recipe))


if __name__ == "__main__":
    main()
