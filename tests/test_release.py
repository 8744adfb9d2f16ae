"""tools/release.py: training checkpoint -> NAME-<sha8>.safetensors + model card, loadable through timm."""
import hashlib
import json
import os

import numpy as np
import pytest
import timm
import torch
from PIL import Image

import datasets
import models  # noqa: F401
from tools import release


def _tiny_checkpoint(tmp_path, num_classes=10, input_size=32, with_ema=True):
    """A training checkpoint of NALAFORMER_XT whose `model` and `model_ema` weights differ."""
    torch.manual_seed(0)
    model = timm.create_model('NALAFORMER_XT', num_classes=num_classes)
    ema = timm.create_model('NALAFORMER_XT', num_classes=num_classes)
    ckpt = {'model': model.state_dict(), 'optimizer': {'state': {}, 'param_groups': []}, 'lr_scheduler': {},
            'epoch': 3, 'scaler': None, 'max_accuracy': 61.5,
            'args': {'model': 'NALAFORMER_XT', 'input_size': input_size, 'eval_crop_ratio': 0.875,
                     'data_set': 'DIGITS'}}
    if with_ema:
        ckpt['model_ema'] = ema.state_dict()
    path = tmp_path / 'run' / 'checkpoint.pth'
    path.parent.mkdir()
    torch.save(ckpt, path)
    with open(path.parent / 'log.txt', 'w') as f:
        for epoch, acc in ((2, 50.0), (3, 60.25)):
            f.write(json.dumps({'epoch': epoch, 'test_acc1': acc, 'test_ema_acc1': acc + 1}) + '\n')
    return path, model, ema


def _logits(model, seed=1):
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model.eval()(x)


@pytest.mark.parametrize('weights', ['default', 'model', 'model_ema'])
def test_release_loads_through_timm_with_the_chosen_weights(tmp_path, one_thread, weights):
    path, model, ema = _tiny_checkpoint(tmp_path)
    info = release.release(str(path), str(tmp_path / 'out'), weights=weights, flops=False)
    chosen = model if weights == 'model' else ema
    other = ema if weights == 'model' else model
    assert info['weights'] == ('model' if weights == 'model' else 'model_ema')

    file = info['file']
    name = os.path.basename(file)
    with open(file, 'rb') as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    assert name == f'nalaformer_xt_32-{sha[:8]}.safetensors'
    assert sorted(os.listdir(tmp_path / 'out')) == sorted([name, name.replace('.safetensors', '.md')])

    loaded = timm.create_model('NALAFORMER_XT', pretrained=True, num_classes=10,
                               pretrained_cfg_overlay=dict(file=file, num_classes=10))
    out = _logits(loaded)
    torch.testing.assert_close(out, _logits(chosen), rtol=0, atol=0)
    assert not torch.allclose(out, _logits(other))


def test_release_strips_everything_but_weights(tmp_path, one_thread):
    from safetensors.torch import load_file
    path, model, _ = _tiny_checkpoint(tmp_path, with_ema=False)
    info = release.release(str(path), str(tmp_path / 'out'), flops=False)
    assert info['weights'] == 'model'
    tensors = load_file(info['file'])
    assert set(tensors) == set(model.state_dict())


def test_model_card_records_size_params_eval_and_source(tmp_path, one_thread):
    path, model, _ = _tiny_checkpoint(tmp_path)
    info = release.release(str(path), str(tmp_path / 'out'), flops=True)
    with open(info['card']) as f:
        card = f.read()
    assert card.startswith(f"# {os.path.basename(info['file'])[:-len('.safetensors')]}")
    assert 'Input size: 32x32' in card
    assert f'({sum(p.numel() for p in model.parameters())})' in card
    assert info['gflops'] > 0 and 'FLOPs:' in card
    # max_accuracy from the checkpoint, test metrics of its epoch (3) from log.txt, not epoch 2's
    assert 'max_accuracy 61.50' in card and 'test_acc1 60.25' in card and 'test_ema_acc1 61.25' in card
    assert str(path) in card and 'weights `model_ema`' in card
    assert 'License:' in card


@pytest.mark.parametrize('input_size', [32, 48])
def test_model_card_code_gives_timm_users_main_evals_transform(tmp_path, one_thread, monkeypatch, input_size):
    """The card's loading lines, run as written: timm's own data config of that model reproduces the
    evaluation transform the run used (for <= 32 px that needs crop_mode 'squash' in the overlay)."""
    path, _, ema = _tiny_checkpoint(tmp_path, input_size=input_size)
    info = release.release(str(path), str(tmp_path / 'out'), flops=False)
    with open(info['card']) as f:
        code = f.read().split('```python\n')[1].split('```')[0]
    monkeypatch.chdir(tmp_path / 'out')
    scope = {}
    exec(code, scope)
    timm_eval = timm.data.create_transform(**timm.data.resolve_data_config({}, model=scope['model']))
    main_eval = datasets.build_transform(False, datasets.data_config('NALAFORMER_XT', input_size, 0.875))
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (37, 81, 3), dtype=np.uint8))
    assert torch.equal(timm_eval(img), main_eval(img)) and main_eval(img).shape == (3, input_size, input_size)
    torch.testing.assert_close(_logits(scope['model']), _logits(ema), rtol=0, atol=0)


def test_missing_ema_with_weights_model_ema_is_a_clear_error(tmp_path, capsys):
    path, _, _ = _tiny_checkpoint(tmp_path, with_ema=False)
    with pytest.raises(SystemExit) as e:
        release.main([str(path), '--output-dir', str(tmp_path / 'out'), '--weights', 'model_ema', '--no-flops'])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and 'no EMA weights' in err and '--weights model' in err
    assert not (tmp_path / 'out').exists()


def test_model_card_lines_work_where_release_ran(tmp_path, one_thread, monkeypatch, capsys):
    """As in README: release.py into a relative --output-dir, then the card's lines pasted in that same
    directory (the card names the file by that relative path, not its bare name)."""
    import shlex

    from tools import predict
    _, _, ema = _tiny_checkpoint(tmp_path)
    monkeypatch.chdir(tmp_path)
    info = release.release(os.path.join('run', 'checkpoint.pth'), 'release', flops=False)
    with open(info['card']) as f:
        card = f.read()
    assert 'Run these in the directory `tools/release.py` ran in (the paths are relative to it' in card
    scope = {}
    exec(card.split('```python\n')[1].split('```')[0], scope)
    torch.testing.assert_close(_logits(scope['model']), _logits(ema), rtol=0, atol=0)

    os.makedirs('images')
    Image.new('RGB', (40, 40), (200, 10, 10)).save(os.path.join('images', 'a.png'))
    argv = shlex.split(card.split('```bash\n')[1].split('```')[0])
    assert argv[:3] == ['python', 'tools/predict.py', 'IMAGES']
    capsys.readouterr()
    assert predict.main(['images'] + argv[3:]) == 0
    assert capsys.readouterr().out.startswith('image,rank,class_index')


@pytest.mark.parametrize('umask', [0o022, 0o077])
def test_the_release_file_gets_the_mode_the_umask_gives_as_any_file_written_there(tmp_path, umask):
    """Readable by the group and others on a shared file system under the usual umask 022, as its model card."""
    path, _, _ = _tiny_checkpoint(tmp_path)
    old = os.umask(umask)
    try:
        info = release.release(str(path), str(tmp_path / 'rel'), flops=False)
    finally:
        os.umask(old)
    for written in (info['file'], info['card']):
        assert os.stat(written).st_mode & 0o777 == 0o666 & ~umask, (written, oct(os.stat(written).st_mode))


def test_an_unknown_model_name_gets_the_closest_variant(tmp_path):
    path, _, _ = _tiny_checkpoint(tmp_path)
    with pytest.raises(release.UserError, match=r"unknown model 'nalaformer-xt' \(did you mean NALAFORMER_XT\?\)"):
        release.release(str(path), str(tmp_path / 'rel'), model_name='nalaformer-xt', flops=False)


def test_timm_names_a_missing_pretrained_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r'^NALAFORMER_XT: pretrained file nope/x\.safetensors does not exist '
                                                r'\(a relative path is read from the working directory, '):
        timm.create_model('NALAFORMER_XT', pretrained=True, pretrained_cfg_overlay=dict(file='nope/x.safetensors'))


def _accuracies(tmp_path, model_acc, ema_acc, classes=None):
    """The tiny checkpoint with this epoch's recorded top-1 of both sets of weights (as main.py saves it)."""
    path, model, ema = _tiny_checkpoint(tmp_path, num_classes=3)
    ckpt = torch.load(path, weights_only=True)
    ckpt['acc1'] = {'model': model_acc, 'model_ema': ema_acc}
    if classes:
        ckpt['classes'] = classes
    torch.save(ckpt, path)
    return str(path), model, ema


def test_default_ema_weights_worse_than_the_model_are_refused_naming_both_choices(tmp_path, capsys):
    path, _, _ = _accuracies(tmp_path, 33.33, 0.0)
    out = str(tmp_path / 'out')
    with pytest.raises(SystemExit) as e:
        release.main([path, '--output-dir', out, '--no-flops'])
    assert e.value.code == 2 and not os.path.exists(out)
    (err,) = capsys.readouterr().err.splitlines()
    assert err.endswith(f': error: {path}: the EMA weights, taken by default, recorded top-1 0.00%, the model '
                        f'weights 33.33%: pass --weights model to release the better ones, or --weights model_ema '
                        f'to release these anyway')
    for weights, taken in (('model', 'the model weights (model)'), ('model_ema', 'the EMA weights (model_ema)')):
        assert release.main([path, '--output-dir', out, '--no-flops', '--weights', weights]) == 0
        first = capsys.readouterr().out.splitlines()[0]
        assert first.startswith(f'Released {taken}; recorded top-1 at epoch 3: ')
        assert 'model 33.33%' in first and 'EMA 0.00%' in first


def test_the_console_names_the_weights_taken_and_both_recorded_accuracies(tmp_path, capsys):
    path, _, _ = _tiny_checkpoint(tmp_path)  # no acc1 entry: the figures of log.txt's line of its epoch
    assert release.main([str(path), '--output-dir', str(tmp_path / 'out'), '--no-flops']) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        'Released the EMA weights (model_ema); recorded top-1 at epoch 3: EMA 61.25%, model 60.25%')


def test_the_checkpoints_class_names_go_into_the_release(tmp_path):
    from safetensors import safe_open
    path, _, _ = _accuracies(tmp_path, 50.0, 60.0, classes=['cat', 'dog', 'owl'])
    info = release.release(path, str(tmp_path / 'out'), flops=False)
    with safe_open(info['file'], framework='pt') as f:
        assert json.loads(f.metadata()['classes']) == ['cat', 'dog', 'owl']
    with open(info['card']) as f:
        assert "- Class names: `cat`, `dog`, `owl` (all 3 in the file's metadata" in f.read()
