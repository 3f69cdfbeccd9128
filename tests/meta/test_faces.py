"""Public names whose function shares a module's name stay functions, whatever was imported first."""
import subprocess
import sys

import pytest

CASES = [("lowbit.ops.linear", "from lowbit.ops import linear"),
         ("lowbit.pipelines.quantize_model", "from lowbit.nn import quantize_model"),
         ("lowbit.nn.quant_linear", "from lowbit.ops import linear")]


@pytest.mark.parametrize("first, face", CASES)
def test_face_is_the_function(first, face):
    name = face.split()[-1]
    code = f"import {first}\n{face}\nassert type({name}).__name__ == 'function', type({name})"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
