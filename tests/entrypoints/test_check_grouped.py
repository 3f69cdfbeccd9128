"""`lowbit check` for grouped (MoE) GEMMs: lowbit's own grouped kernels (--grouped RECIPE) pass, a
kind=grouped file passes or has its planted layout bug named, bad input is refused."""
import dataclasses

import pytest
import torch

import lowbit as lb
from lowbit.entrypoints.main import main
from lowbit.ops.grouped import grouped_reference, sort_tokens, take_rows
from moe_fixtures import top_k_index

save_file = pytest.importorskip("safetensors.torch").save_file


@pytest.mark.parametrize("recipe,E,K,routing", [("w8a8-int8", 3, 64, "hot"), ("mxfp8", 5, 160, "dropped"),
                                                ("w4a16-g32", 5, 96, "sparse")])
def test_check_grouped_recipe_passes(recipe, E, K, routing, seed, capsys):
    argv = ["check", "--grouped", recipe, "--experts", str(E), "--tokens", "7", "--n", "24", "--k", str(K),
            "--routing", routing, "--seed", str(seed)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("check_grouped_linear: PASS") == 2, out     # gathered activations and the sorted buffer
    assert f"--grouped {recipe}" in out and f"E={E}" in out


def _write(path, out, x, w, offsets, **meta):
    save_file({"out": out.float().contiguous(), "x": x.contiguous(), "w": w.contiguous(), "offsets": offsets},
              str(path), metadata={"kind": "grouped", **meta})


def test_check_grouped_file_pass_and_planted_bug(rng, tmp_path, capsys):
    """A kernel that multiplies expert e's rows with expert e+1's weight scales is named."""
    E, T, N, K = 5, 9, 24, 64
    xs, ws = lb.get_preset("int8_token"), lb.get_preset("int8_channel")
    x = torch.randn(T, K, generator=rng)
    w = torch.randn(E, N, K, generator=rng) * torch.exp(torch.randn(E, N, 1, generator=rng))
    routing = sort_tokens(top_k_index(rng, T, E, 2, "uniform"), E)
    xb = x[routing.token]
    xq = lb.quantize(xb, xs)
    wq = [lb.quantize(w[e], ws) for e in range(E)]
    good = grouped_reference(xq, routing.offsets, wq)
    _write(tmp_path / "good.safetensors", good, xb, w, routing.offsets, x_scheme="int8_token", w_scheme="int8_channel")
    assert main(["check", str(tmp_path / "good.safetensors")]) == 0
    assert "check_grouped_linear: PASS" in capsys.readouterr().out
    shifted = [dataclasses.replace(q, scale=wq[(e + 1) % E].scale) for e, q in enumerate(wq)]
    bad = grouped_reference(take_rows(xq, torch.arange(routing.rows)), routing.offsets, shifted)
    _write(tmp_path / "bad.safetensors", bad, xb, w, routing.offsets, x_scheme="int8_token", w_scheme="int8_channel")
    assert main(["check", str(tmp_path / "bad.safetensors")]) == 1
    assert "cause: scales_of_next" in capsys.readouterr().out


def test_check_grouped_bad_input(rng, tmp_path, capsys):
    assert main(["check", "--grouped", "w8a8-int8", "--experts", "2", "--top-k", "3"]) == 2
    assert "--top-k 3 > --experts 2" in capsys.readouterr().err
    assert main(["check"]) == 2
    assert "--grouped RECIPE" in capsys.readouterr().err
    assert main(["check", "x.safetensors", "--grouped", "w8a8-int8"]) == 2
    assert "not both" in capsys.readouterr().err
    save_file({"out": torch.zeros(3, 4), "x": torch.zeros(3, 8), "w": torch.zeros(2, 4, 8)},
              str(tmp_path / "f.safetensors"), metadata={"kind": "grouped", "x_scheme": "none", "w_scheme": "none"})
    assert main(["check", str(tmp_path / "f.safetensors")]) == 2
    assert "missing tensor(s) ['offsets']" in capsys.readouterr().err
