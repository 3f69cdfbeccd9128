"""`pip install lowbit` without the gpu extra: quantizing a model and running it on the CPU must
not need triton. A child process where `import triton` fails (as it does when the package is
absent) quantizes a tiny random Llama under every recipe and runs it; its output is compared
with the same model run here, where triton is importable and the CPU runs the same exact paths."""
import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

CHILD = r"""
import json, sys
sys.modules["triton"] = None            # `import triton` now raises ImportError, as when it is absent
import torch, transformers
from lowbit.nn import quantize_model, RECIPES
cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
seed, out = int(sys.argv[1]), {}
for name in RECIPES:
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(seed))
    quantize_model(model, name)
    with torch.no_grad():
        out[name] = model(ids).logits.flatten().tolist()
assert "triton" not in [m.split(".")[0] for m in sys.modules if sys.modules[m] is not None]
print(json.dumps(out))
"""


def test_every_recipe_runs_on_the_cpu_without_triton(seed):
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, "-c", CHILD, str(seed % 2**31)], capture_output=True, text=True,
                         env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    from lowbit.nn import RECIPES, quantize_model
    assert set(got) == set(RECIPES)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    for name, logits in got.items():
        torch.manual_seed(seed % 2**31)
        model = transformers.LlamaForCausalLM(cfg).eval()
        ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(seed % 2**31))
        quantize_model(model, name)
        with torch.no_grad():
            want = model(ids).logits.flatten()
        # the same exact CPU path in both processes (no kernel runs on the CPU by default): equal bits
        assert torch.equal(torch.tensor(logits, dtype=want.dtype), want), name
