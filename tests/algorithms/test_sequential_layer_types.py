"""Sequential calibration on a model whose blocks get different attention masks (config.layer_types
mixing sliding-window and full attention): every block is calibrated with its own mask, so the
inputs a handler receives are the inputs of that layer in the finished model."""
import torch

import lowbit as lb
from lowbit.algorithms.sequential import block_kwargs, calibrate_sequentially
from lowbit.nn.quant_linear import QuantLinear


def _gemma2(rng):
    import transformers as T
    cfg = T.Gemma2Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                         sliding_window=4, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=rng)))
    return T.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()


def test_each_block_gets_its_own_mask(rng):
    """Sequences of 13 tokens, sliding window 4: the sliding and full masks differ, and a block
    calibrated with another block's mask would see other inputs from its attention onward."""
    model = _gemma2(rng)
    batches = [torch.randint(0, 97, (1, 13), generator=rng) for _ in range(2)]
    per = block_kwargs(model, model.model.layers, batches)
    assert per is not None and len(per) == 3
    scheme = lb.QuantScheme(format="int4", strategy="group", group_size=16)
    got = {}

    def handle(names, xs):
        for n in names:
            got[n] = xs
        return {n: QuantLinear.from_linear(model.get_submodule(n), scheme) for n in names}

    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    calibrate_sequentially(model, names, batches, handle)
    seen = {}
    hooks = [model.get_submodule(n).register_forward_pre_hook(
        lambda mod, a, n=n: seen.setdefault(n, []).append(a[0].detach())) for n in names]
    with torch.no_grad():
        for b in batches:
            model(b)
    for h in hooks:
        h.remove()
    for n in names:
        assert all(torch.equal(a, b) for a, b in zip(got[n], seen[n], strict=True)), n


def test_uniform_layer_types_capture_nothing_more(rng):
    import transformers as T
    cfg = T.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    model = T.LlamaForCausalLM(cfg).eval()
    assert block_kwargs(model, model.model.layers, [torch.zeros(1, 4, dtype=torch.long)]) is None
