"""FLOP counting: plain fvcore sees the same model as models.flop_count, tracers take the plain path, and the
tools/flops.py command line."""
import ast
import logging
import os
import warnings

import pytest
import timm
import torch
from conftest import REPO

import models  # noqa: F401  (registers the variants)
from models.flop_count import count_flops, count_params
from models.ops import use_plain_ops


def raw_fvcore(model, x):
    """FlopCountAnalysis as a user would call it: no custom handles."""
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        from fvcore.nn import FlopCountAnalysis
        logging.getLogger('fvcore').setLevel(logging.ERROR)
        return FlopCountAnalysis(model.eval(), x).total()


def test_plain_fvcore_counts_the_fast_model_like_the_plain_one():
    x = torch.zeros(1, 3, 64, 96)
    model = timm.create_model('NALAFORMER_XT')
    assert model.fast_path
    fast = raw_fvcore(model, x)
    model.set_fast_path(False)
    assert raw_fvcore(model, x) == fast == count_flops(model, (64, 96))


def test_count_flops_accepts_a_side_or_a_shape_and_restores_the_model():
    model = timm.create_model('NALAFORMER_XT')
    state = torch.random.get_rng_state()
    assert count_flops(model, 64) == count_flops(model, (64, 64)) == count_flops(model, (3, 64, 64)) > 0
    assert model.training and torch.equal(state, torch.random.get_rng_state())
    assert count_params(model) == sum(p.numel() for p in model.parameters())


class _Probe(torch.nn.Module):
    """Returns x + 1 when the model would take its plain path, else x."""

    def forward(self, x):
        return x + 1 if use_plain_ops() else x


def test_use_plain_ops_under_every_tracer():
    x = torch.zeros(2)
    probe = _Probe()
    assert torch.equal(probe(x), x)                                        # eager: fast path
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', FutureWarning)                     # torch.jit is deprecated
        assert torch.equal(torch.jit.trace(probe, x, check_trace=False)(x), x + 1)
        assert torch.equal(torch.jit.script(probe)(x), x + 1)
    assert torch.equal(torch.export.export(probe, (x,)).module()(x), x + 1)
    # FX records the fast path (its pieces are leaf calls), so an FX graph computes what eager does
    assert torch.equal(torch.fx.symbolic_trace(probe)(x), x)


def test_main_counts_flops_without_tools():
    tree = ast.parse(open(os.path.join(REPO, 'main.py')).read())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert imported and not [m for m in imported if m and m.split('.')[0] == 'tools']


def test_flops_cli_prints_every_variant(capsys):
    from tools.flops import main
    main(['--model', 'NALAFORMER_XT', 'nalaformer_t', '--input-size', '64', '96'])
    out = capsys.readouterr().out
    assert '3x64x96' in out and 'NALAFORMER_XT' in out and 'nalaformer_t' in out
    with pytest.raises(SystemExit):
        main(['--model', 'NALAFORMER_XXL'])


def test_flops_table_columns_line_up(capsys):
    """Every value of every row ends where its column title ends (B and L have integer paper FLOPs)."""
    import re

    from tools.flops import main
    main(['--model', 'NALAFORMER_XT', 'NALAFORMER_B', '--input-size', '32'])
    lines = capsys.readouterr().out.splitlines()
    header, rows = lines[1], lines[2:]
    title_ends = [m.end() for m in re.finditer(r'\S+(?: \S+)*', header)][1:]  # titles are 2+ spaces apart
    assert len(title_ends) == 5 and len(rows) == 2
    for row in rows:
        assert [m.end() for m in re.finditer(r'\S+', row)][1:] == title_ends, (header, row)
