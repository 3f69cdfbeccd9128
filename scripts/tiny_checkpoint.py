"""Write a tiny random-weight Llama checkpoint quantized by a lowbit recipe, for `lowbit verify-model`
on a machine without a model download (a GPU box): quantize_model + save_compressed, as
`lowbit quantize` writes them.

    python scripts/tiny_checkpoint.py OUT_DIR [RECIPE] [--kv-cache fp8-head] [--moe]
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
    p.add_argument("--moe", action="store_true", help="a Qwen3-MoE model (8 experts of width 256, top 2) instead")
    a = p.parse_args()
    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128)
    if a.moe:
        cfg = transformers.Qwen3MoeConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                                          intermediate_size=512, head_dim=64, **common)
    else:
        cfg = transformers.LlamaConfig(intermediate_size=512, **common)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    kw = {}
    if a.kv_cache:
        kw = {"kv_cache": a.kv_cache, "kv_calib": [torch.randint(0, 256, (2, 32))]}
    quantize_model(model, a.recipe, **kw)
    print(save_compressed(model, a.out, a.recipe))


if __name__ == "__main__":
    main()
