"""The one reader and error class of `lowbit check` files (lowbit.entrypoints.check_file): every
layout's bad file is a BadCheckFile naming the file and the tensor, exit status 2 from the CLI."""
import pytest
import torch

from lowbit.entrypoints import check_file
from lowbit.entrypoints.check_file import BadCheckFile
from lowbit.entrypoints.main import main

save_file = pytest.importorskip("safetensors.torch").save_file


def test_read_returns_every_tensor_and_the_metadata(rng, tmp_path):
    t = {"out": torch.randn(3, 5, generator=rng), "x": torch.randn(3, 7, generator=rng),
         "extra": torch.randint(-9, 9, (4,), generator=rng, dtype=torch.int32)}
    p = tmp_path / "f.safetensors"
    save_file(t, str(p), metadata={"kind": "grouped", "x_scheme": "none"})
    got, meta = check_file.read(str(p))
    assert meta == {"kind": "grouped", "x_scheme": "none"}
    assert set(got) == set(t) and all(torch.equal(got[k], t[k]) for k in t)


def test_read_refuses_a_truncated_file(rng, tmp_path):
    p = tmp_path / "f.safetensors"
    save_file({"out": torch.randn(3, 5, generator=rng)}, str(p))
    p.write_bytes(p.read_bytes()[:-4])
    with pytest.raises(BadCheckFile, match="truncated"):
        check_file.read(str(p))


@pytest.mark.parametrize("kind, tensors, names", [
    (None, {"out": torch.zeros(3, 5), "x": torch.zeros(3, 7, dtype=torch.int32), "w": torch.zeros(5, 7)}, "tensor x is torch.int32"),
    (None, {"out": torch.zeros(3, 5), "x": torch.zeros(3, 7)}, "['w']"),
    ("attention", {"out": torch.zeros(1, 2, 3, 8)}, "['q']"),
    ("attention", {"out": torch.zeros(1, 2, 3, 8), "q": torch.zeros(1, 2, 3, 8, dtype=torch.int8)}, "tensor q"),
    ("grouped", {"out": torch.zeros(3, 4), "x": torch.zeros(3, 8)}, "['offsets', 'w']"),
    ("grouped", {"out": torch.zeros(3, 4, dtype=torch.int16), "x": torch.zeros(3, 8), "w": torch.zeros(2, 4, 8),
                 "offsets": torch.tensor([0, 1, 3])}, "tensor out"),
])
def test_every_layout_names_the_file_and_the_tensor(tmp_path, capsys, kind, tensors, names):
    p = tmp_path / "bad.safetensors"
    meta = {"x_scheme": "none", "w_scheme": "none"} | ({"kind": kind} if kind else {})
    save_file(tensors, str(p), metadata=meta)
    assert main(["check", str(p)]) == 2
    err = capsys.readouterr().err
    assert str(p) in err and names in err, err
