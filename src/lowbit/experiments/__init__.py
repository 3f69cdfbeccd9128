"""The reference experiments (scale policies, error model, MX layouts, outliers) as reproducible reports (`lowbit experiment NAME`).

Each module exposes `run(**opts) -> dict` (rows + notes, JSON-serialisable), `format_table(result)`
and, where a picture helps, `plot(result, path)`.
"""
EXPERIMENTS = ("matmul", "error-model", "layout", "outliers")
