"""Export: ONNX (torch.export-based and legacy), TorchScript and torch.export programs of the default
(fast-path) model match PyTorch, also at a batch size and resolution other than the traced ones."""

import warnings

import pytest
import timm
import torch

import models  # noqa: F401  (registers the variants)
from models.compat import dynamo_onnx_export_error, export_program_error
from tools.export import check_export, main

TOL = 1e-4


@pytest.fixture(scope='module')
def model():
    torch.manual_seed(0)
    model = timm.create_model('NALAFORMER_XT').eval()
    assert model.fast_path
    return model


def assert_parity(results, shapes):
    assert [shape for shape, _ in results] == shapes
    assert all(err < TOL for _, err in results), results


DYNAMIC_SHAPES = [(2, 3, 64, 64), (3, 3, 96, 64)]


# torch.export-based exports trace symbolically: about a minute each for XT on 2 busy cores, hence slow
@pytest.mark.parametrize('legacy', [pytest.param(False, marks=pytest.mark.slow), True], ids=['dynamo', 'legacy'])
def test_onnx_runtime_matches_pytorch_at_other_sizes(model, tmp_path, legacy):
    pytest.importorskip('onnx')
    pytest.importorskip('onnxruntime')
    if not legacy:
        pytest.importorskip('onnxscript')
        if dynamo_onnx_export_error():
            pytest.skip(dynamo_onnx_export_error())
    results = check_export(model, 'onnx', str(tmp_path / 'm.onnx'), 64, dynamic=True, legacy_onnx=legacy)
    assert_parity(results, DYNAMIC_SHAPES)


def test_torchscript_trace_save_load(model, tmp_path):
    assert_parity(check_export(model, 'torchscript', str(tmp_path / 'm.pt'), 64, dynamic=True), DYNAMIC_SHAPES)


@pytest.mark.slow
def test_torch_export_save_load(model, tmp_path):
    if export_program_error():
        pytest.skip(export_program_error())
    results = check_export(model, 'exported-program', str(tmp_path / 'm.pt2'), 64, dynamic=True)
    assert_parity(results, DYNAMIC_SHAPES)


def test_cli_exports_a_checkpoint_with_its_head(tmp_path, capsys):
    trained = timm.create_model('NALAFORMER_XT', num_classes=10)
    ckpt = tmp_path / 'checkpoint.pth'
    torch.save({'model': trained.state_dict(), 'epoch': 3}, ckpt)
    out = tmp_path / 'm.pt'
    assert main(['--checkpoint', str(ckpt), '--format', 'torchscript', '--output', str(out),
                 '--input-size', '32']) == 0
    printed = capsys.readouterr().out
    assert 'input 1x3x32x32: max |exported - PyTorch| =' in printed
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        with warnings.catch_warnings():
            warnings.simplefilter('ignore', FutureWarning)  # recent torch deprecates torch.jit.load
            loaded = torch.jit.load(str(out))
        assert torch.allclose(loaded(x), trained.eval()(x), atol=TOL)


@pytest.mark.parametrize('argv, message', [
    (['--format', 'torchscript', '--checkpoint', 'missing.pth'], 'missing.pth: no such file'),
    (['--format', 'exported-program'], 'name it *.pt2'),
    (['--format', 'torchscript', '--model', 'NALAFORMER_XXL'], 'unknown --model NALAFORMER_XXL'),
    (['--format', 'torchscript', '--input-size', '16'], 'at least 32'),
])
def test_cli_rejects_bad_input_in_one_line(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv + ['--output', str(tmp_path / 'm.pt')])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
