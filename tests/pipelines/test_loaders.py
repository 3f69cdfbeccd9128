"""The loader table (lowbit.recipes.loaders) against the real loader: every recipe's checkpoint of a
tiny random dense model (Llama, Qwen2, Gemma2: its Linears quantized) and MoE model (Mixtral,
Qwen3-MoE: its experts quantized, every Linear kept in float, so each part is tested alone),
loaded with the pinned transformers' `AutoModelForCausalLM.from_pretrained(dir)`.

Where the table says transformers loads it: the weights it holds are lowbit's dequantized weights
(bit for bit; NVFP4 within compressed-tensors' bf16 rounding), each dense layer carries the
recipe's activation scheme, and its logits match lowbit's model within the derived gate (both with
activations unquantized: transformers' int8 activation quantizer rounds with another scale, which
is the loader's arithmetic, not the checkpoint's). Where the table says it does not: loading or
running fails, or the logits leave that gate, so a transformers fix turns the test red."""
import pathlib

import pytest
import torch

from lowbit.io.ct_layout import args_to_scheme
from lowbit.nn.experts import QuantExperts
from lowbit.nn.quant_linear import QuantLinear
from lowbit.pipelines.checkpoint import save_compressed
from lowbit.pipelines.quantize_model import quantize_model
from lowbit.recipes.compat import stored_group
from lowbit.recipes.loaders import PARTS, cell, markdown_table
from lowbit.recipes.presets import RECIPES
from family_fixtures import logits_gate, tiny_decoder
from moe_fixtures import ids, tiny_moe

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

DENSE = ("llama", "qwen2", "gemma2")
MOE = ("mixtral", "qwen3_moe")
# every recipe on one dense and one MoE family, the others in turn: each family meets several recipes
CELLS = [(f, r) for i, r in enumerate(RECIPES) for f in (DENSE[0], DENSE[1 + i % 2], MOE[i % 2])]
# compressed-tensors decompresses NVFP4 in bf16 (2^-8 relative) after dividing by the stored 1 / g
# (one float32 rounding of g, 2^-24 relative; 2^-22 covers both operands' roundings)
TWO_LEVEL_REL = 2.0 ** -8 + 2.0 ** -22


def _model(family: str, recipe: str, rng):
    """A one-layer float32 model with `recipe` applied to its Linears (dense) or its experts (MoE)."""
    wide = stored_group(RECIPES[recipe]) == 128          # groups of 128 need K = 128
    width = 128 if wide else 64
    if family in MOE:
        m = tiny_moe(family, rng, dtype=torch.float32, experts=4, width=width, layers=1)
        ignore = [n for n, x in m.named_modules() if isinstance(x, torch.nn.Linear)]
    else:
        m = tiny_decoder(family, rng, hidden_size=width, intermediate_size=width + 32 * (not wide),
                         num_hidden_layers=1).float()
        g = stored_group(RECIPES[recipe]) or 1
        ignore = [n for n, x in m.named_modules() if isinstance(x, torch.nn.Linear) and x.in_features % g]
    quantize_model(m, recipe, ignore=ignore or None)
    return m


def _load(path):
    """transformers' model of the checkpoint, decompressed (what its first forward does) with the
    weights compressed-tensors leaves in bf16 widened to float32 (exact) for a float32 comparison."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    if hasattr(hf, "set_experts_implementation"):    # transformers' grouped_mm does not take every dtype
        hf.set_experts_implementation("eager")
    hf.hf_quantizer.compressor.decompress_model(hf)
    for p in hf.parameters():
        if p.dtype == torch.bfloat16:
            p.data = p.data.float()
    for x in hf.modules():       # lowbit's side runs activations unquantized too (see the module docstring)
        if getattr(x, "quantization_scheme", None) is not None:
            x.quantization_enabled = False
    return hf


def _same(got: torch.Tensor, want: torch.Tensor, rel: float, where: str) -> None:
    if rel == 0.0:
        assert torch.equal(got.float(), want.float()), where
    else:
        assert bool(((got.double() - want.double()).abs() <= rel * want.double().abs()).all()), where


@pytest.mark.parametrize("family,recipe", CELLS)
def test_transformers_loads_what_the_table_says(family, recipe, rng, tmp_path):
    part = "experts" if family in MOE else "dense"
    r = RECIPES[recipe]
    m = _model(family, recipe, rng)
    quantized = {n: x for n, x in m.named_modules() if isinstance(x, (QuantLinear, QuantExperts))}
    assert quantized and all(isinstance(x, QuantExperts) == (part == "experts") for x in quantized.values())
    out = save_compressed(m, tmp_path / "ck", recipe)
    for x in quantized.values():
        x.act_scheme = None
    t = ids(rng, 11)
    with torch.no_grad():
        ref = m(t).logits
    rel = TWO_LEVEL_REL if r.weight.two_level else 0.0
    gate = logits_gate(m.config, ref, rel)
    loads, why = cell("transformers", part, r)
    if not loads:
        try:
            hf = _load(out)
            with torch.no_grad():
                got = hf(t).logits
        except RuntimeError:
            return           # refused at load or at the first forward, as the table says
        err = (got - ref).abs().max().item()
        assert not err <= gate, f"transformers now loads {recipe} {part} (table: {why}); update lowbit.recipes.loaders"
        return
    hf = _load(out)
    for n, x in quantized.items():
        h = hf.get_submodule(n)
        if part == "experts":
            for p in ("gate_up", "down"):
                _same(getattr(h, p + "_proj"), x.weight_dequantized(p, torch.float64), rel, f"{n} {p}")
            continue
        _same(h.weight, x.weight_q.dequantize(torch.float64), rel, n)
        acts = h.quantization_scheme.input_activations
        assert (acts is None) == (r.act is None), n
        if acts is not None:
            s = args_to_scheme(acts.model_dump())
            assert (s.format, s.strategy, s.group_size, s.symmetric) == \
                (r.act.format, r.act.strategy, r.act.group_size, r.act.symmetric), n
    with torch.no_grad():
        got = hf(t).logits
    assert (got - ref).abs().max().item() <= gate


DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"


@pytest.mark.parametrize("doc,parts", [("checkpoints.md", PARTS), ("moe.md", ("experts",))])
def test_docs_carry_the_code_table(doc, parts):
    """The tables users read are the table the warnings and the matrix above use, word for word."""
    text = (DOCS / doc).read_text()
    start = text.index("<!-- generated by lowbit.recipes.loaders.markdown_table(")
    body = text[text.index("\n", start) + 1: text.index("<!-- end of the generated table -->", start)]
    assert body.strip() == markdown_table(parts), f"regenerate the table in docs/{doc} from markdown_table()"
