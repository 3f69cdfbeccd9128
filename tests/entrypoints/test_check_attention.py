"""`lowbit check` on an attention file: pass, a planted bug named, a bad file refused."""
import pytest
import torch

from lowbit.entrypoints.main import main
from lowbit.ops import attention_reference as ar
from lowbit.ops.attention import attention
from lowbit.ops.kv_quant import KVScheme, quantize_kv

save_file = pytest.importorskip("safetensors.torch").save_file


def _write(path, out, q, kq, vq, **meta):
    tensors = {"out": out.contiguous(), "q": q, "k_codes": kq.codes, "k_scale": kq.scale.contiguous(),
               "v_codes": vq.codes, "v_scale": vq.scale.contiguous()}
    save_file(tensors, str(path), metadata={"kind": "attention", "kv_scheme": "fp8-token", "p_block": "16",
                                            "causal": "true", **meta})


def test_check_attention_file(rng, tmp_path, capsys):
    q = torch.randn(1, 4, 6, 24, generator=rng)
    sch = KVScheme.parse("fp8-token")
    kq = quantize_kv(torch.randn(1, 2, 30, 24, generator=rng), sch)
    vq = quantize_kv(torch.randn(1, 2, 30, 24, generator=rng), sch)
    spec = ar.AttnSpec(p_block=16)
    good = attention(q, kq, vq, spec, backend="torch")
    _write(tmp_path / "good.safetensors", good, q, kq, vq)
    assert main(["check", str(tmp_path / "good.safetensors")]) == 0
    assert "check_attention: PASS" in capsys.readouterr().out
    # a kernel that forgot V's scale
    bad = attention(q, kq, vq.decoded().reshape(vq.shape), spec, backend="torch")
    _write(tmp_path / "bad.safetensors", bad, q, kq, vq)
    assert main(["check", str(tmp_path / "bad.safetensors")]) == 1
    assert "cause: v_scale_missing" in capsys.readouterr().out
    save_file({"out": good.contiguous(), "q": q, "k_codes": kq.codes, "k_scale": kq.scale.contiguous()},
              str(tmp_path / "broken.safetensors"), metadata={"kind": "attention", "kv_scheme": "fp8-token"})
    assert main(["check", str(tmp_path / "broken.safetensors")]) == 2
    assert "the cache is missing" in capsys.readouterr().err
