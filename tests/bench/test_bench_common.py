"""bench.common.write_run: the one writer of a benchmark run's JSON file, read back by the reports."""
import json

import torch

from lowbit.bench.common import write_run


def test_write_run_round_trips_and_keeps_the_key_order(rng, tmp_path):
    rows = [{"name": f"r{i}", "ms": float(torch.rand((), generator=rng)), "dtype": torch.bfloat16}
            for i in range(int(torch.randint(1, 5, (), generator=rng)))]
    p = tmp_path / "run.json"
    write_run(str(p), {"gpu": "none"}, rows, notes=["a note"])
    back = json.loads(p.read_text())
    assert list(back) == ["environment", "notes", "rows"]
    assert back["environment"] == {"gpu": "none"} and back["notes"] == ["a note"]
    # default=str: a value JSON cannot hold is written as its str, the rest exactly
    assert back["rows"] == [dict(r, dtype="torch.bfloat16") for r in rows]
    write_run(str(p), {}, [])
    assert list(json.loads(p.read_text())) == ["environment", "rows"]
