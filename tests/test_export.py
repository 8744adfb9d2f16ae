"""Export: ONNX (torch.export-based and legacy), TorchScript and torch.export programs of the default
(fast-path) model match PyTorch, also at a batch size and resolution other than the traced ones."""

import os
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
    (['--format', 'torchscript', '--model', 'NALAFORMER_XXL'], "--model: unknown model 'NALAFORMER_XXL'"),
    (['--format', 'torchscript', '--input-size', '16'], 'at least 32'),
])
def test_cli_rejects_bad_input_in_one_line(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv + ['--output', str(tmp_path / 'm.pt')])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def _tiny():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten()).eval()


def _run_onnx(path, x):
    import onnxruntime
    session = onnxruntime.InferenceSession(str(path), providers=['CPUExecutionProvider'])
    return torch.from_numpy(session.run(None, {'images': x.numpy()})[0])


def test_onnx_export_is_one_self_contained_file(tmp_path):
    """Weights under ONNX's 2 GB limit stay inside the .onnx file: it runs when copied alone."""
    pytest.importorskip('onnxscript')
    pytest.importorskip('onnxruntime')
    import shutil

    from tools.export import export_model
    model, x = _tiny(), torch.randn(1, 3, 32, 32)
    assert export_model(model, x, 'onnx', str(tmp_path / 'm.onnx')) == [str(tmp_path / 'm.onnx')]
    assert sorted(os.listdir(tmp_path)) == ['m.onnx']
    (tmp_path / 'copy').mkdir()
    shutil.copy(tmp_path / 'm.onnx', tmp_path / 'copy' / 'm.onnx')
    with torch.no_grad():
        assert torch.allclose(_run_onnx(tmp_path / 'copy' / 'm.onnx', x), model(x), atol=TOL)


def test_onnx_weights_over_the_limit_go_to_a_data_file_that_is_named(tmp_path, monkeypatch):
    pytest.importorskip('onnxscript')
    pytest.importorskip('onnxruntime')
    import tools.export
    monkeypatch.setattr(tools.export, 'ONNX_PROTOBUF_LIMIT', 1)  # as if the weights exceeded 2 GB
    lines = []
    results = check_export(_tiny(), 'onnx', str(tmp_path / 'm.onnx'), 32, log=lines.append)
    assert sorted(os.listdir(tmp_path)) == ['m.onnx', 'm.onnx.data'] and results[0][1] < TOL
    assert any(f'wrote {tmp_path}/m.onnx and {tmp_path}/m.onnx.data' in line
               and 'keep m.onnx.data next to m.onnx' in line for line in lines), lines


def test_cli_prints_each_phase_and_seeds_random_weights(tmp_path, capsys):
    outputs = []
    for run in range(2):
        out = tmp_path / f'm{run}.pt'
        assert main(['--format', 'torchscript', '--output', str(out), '--input-size', '32']) == 0
        printed = capsys.readouterr().out.splitlines()
        starts = ['building NALAFORMER_XT with random weights (--seed 0; no --checkpoint given)',
                  f'exporting to {out} (torchscript) ...', f'wrote {out} in ',
                  'running the exported file on 1 input(s) and comparing with PyTorch ...',
                  'input 1x3x32x32: max |exported - PyTorch| = ']
        assert len(printed) == len(starts) and all(p.startswith(s) for p, s in zip(printed, starts)), printed
        with warnings.catch_warnings():
            warnings.simplefilter('ignore', FutureWarning)  # torch.jit.load is deprecated
            outputs.append(torch.jit.load(str(out))(torch.ones(1, 3, 32, 32)))
    assert torch.equal(outputs[0], outputs[1])  # the same random weights both times
