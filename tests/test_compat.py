"""models.compat: each version-dependent call works through the current API and through the fallback
taken on older torch releases (forced here by hiding the current API)."""
import argparse
import math

import pytest
import torch

from models import compat
from models.ops import use_plain_ops
from tools import export


class Probe(torch.nn.Module):
    """Adds 1 where use_plain_ops() says the plain path, 2 where not, and 10 more while FX traces: what a
    tracer or compiler saw shows in the output of the graph it made (attribute writes in forward are not
    reliably kept by export)."""

    def forward(self, x):
        return x + (1 if use_plain_ops() else 2) + (10 if compat.is_fx_symbolic_tracing() else 0)


@pytest.fixture(params=['current', 'fallback'])
def api(request, monkeypatch):
    """Run a test with the current APIs and again with them hidden, as on torch 2.4."""
    if request.param == 'fallback':
        for name in ('_FX_SYMBOLIC_TRACING', '_IS_EXPORTING', '_SAFE_GLOBALS', '_DIM_DYNAMIC', '_GET_TOTAL_NORM'):
            monkeypatch.setattr(compat, name, None)
    return request.param


def test_plain_ops_under_each_tracer_and_not_under_compile_or_eager(api):
    """Exporters take the plain path; FX tracing is seen but records the fast path (its pieces are leaf
    calls); torch.compile and eager run the fast path."""
    probe, x = Probe(), torch.zeros(2)
    assert probe(x).tolist() == [2, 2]
    assert torch.fx.symbolic_trace(probe)(x).tolist() == [12, 12]
    assert torch.export.export(probe, (x,)).module()(x).tolist() == [1, 1]
    assert torch.export.export(probe, (x,), strict=False).module()(x).tolist() == [1, 1]
    torch._dynamo.reset()
    assert torch.compile(probe, backend='eager')(x).tolist() == [2, 2]
    assert compat.is_fx_symbolic_tracing() is False and compat.is_exporting() is False


def test_safe_globals_allows_the_classes_only_inside_the_block(api, tmp_path):
    path = tmp_path / 'ns.pth'
    torch.save({'args': argparse.Namespace(lr=0.1)}, path)
    with compat.safe_globals([argparse.Namespace]):
        assert torch.load(path, weights_only=True)['args'].lr == 0.1
    with pytest.raises(Exception, match='Namespace'):
        torch.load(path, weights_only=True)


def test_export_dim_gives_a_free_dimension(api):
    # an odd and an even batch from one program whose batch was traced at 2
    dims = ({0: compat.export_dim('batch')},)
    program = torch.export.export(torch.nn.Linear(3, 2), (torch.randn(2, 3),), dynamic_shapes=dims)
    assert program.module()(torch.randn(5, 3)).shape == (5, 2)


def test_total_norm_is_the_norm_of_all_tensors_together(api):
    tensors = [torch.tensor([3.0, 0.0]), torch.tensor([[4.0]]), torch.zeros(3)]
    assert torch.allclose(compat.total_norm(tensors), torch.tensor(5.0))
    # the largest magnitude: NaN as soon as one element is NaN, inf with an inf (non-finite gradients)
    assert compat.total_norm(tensors, math.inf) == 4.0
    assert compat.total_norm(tensors + [torch.tensor([1.0, float('nan')])], math.inf).isnan()
    assert compat.total_norm(tensors + [torch.tensor([-float('inf')])], math.inf) == math.inf


def test_arange_of_a_traced_size_is_recorded_by_fx():
    class Positions(torch.nn.Module):
        def forward(self, x):
            return x + compat.arange(x.shape[-1], dtype=x.dtype, device=x.device)

    traced = torch.fx.symbolic_trace(Positions())
    x = torch.zeros(2, 7)  # the graph follows the input's size
    assert torch.equal(traced(x), torch.arange(7.0).expand(2, 7))


def test_dynamo_onnx_export_names_the_torch_it_needs(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(compat, 'TORCH_VERSION', (2, 4))
    reason = compat.dynamo_onnx_export_error()
    assert 'needs torch >= 2.6' in reason and '--legacy-onnx' in reason
    with pytest.raises(SystemExit) as ei:
        export.main(['--format', 'onnx', '--output', str(tmp_path / 'm.onnx')])
    assert ei.value.code == 2 and 'needs torch >= 2.6' in capsys.readouterr().err
    monkeypatch.setattr(compat, 'TORCH_VERSION', (2, 6))
    assert compat.dynamo_onnx_export_error() is None


def test_export_program_without_dim_dynamic_names_the_torch_it_needs(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(compat, '_DIM_DYNAMIC', None)
    assert 'needs torch >= 2.6' in compat.export_program_error()
    with pytest.raises(SystemExit) as ei:
        export.main(['--format', 'exported-program', '--output', str(tmp_path / 'm.pt2')])
    assert ei.value.code == 2 and 'needs torch >= 2.6' in capsys.readouterr().err


def test_torch_version_parsing():
    assert compat._release('2.4.0+cu121') == (2, 4) and compat._release('2.14.1') == (2, 14)
    assert compat.torch_at_least('2.4')
