"""The reference key layout (stage i holds the downsample that runs after it), which the reference's
checkpoints and this repository's older ones have: every loader maps it onto the model's layout (stage
i+1 holds that downsample), training resumes from it bit-exactly, and our weights convert back to it."""
import importlib.util
import os

import timm
import torch
from conftest import REPO, TrainingRun, optimizer_of, scheduler_of
from helpers.reference_impl import read_keys, reference_forward

import cli
from models.nalaformer import checkpoint_filter_fn, from_reference_layout, is_reference_layout, to_reference_layout
from run import checkpoint, weights
from tools import analyze_attention, predict, release

KEYS = os.path.join(REPO, 'tests', 'reference', 'NALAFORMER_XT.keys.txt')
X = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))


def _xt(seed, num_classes=3, **kwargs):
    torch.manual_seed(seed)
    return timm.create_model('NALAFORMER_XT', num_classes=num_classes, **kwargs)


def _same(a, b):
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_the_maps_are_inverse_and_keep_key_order():
    own = _xt(0, num_classes=1000).state_dict()
    ref = to_reference_layout(own)
    assert [k for k, _, _ in read_keys(KEYS)] == list(ref)
    assert is_reference_layout(ref) and not is_reference_layout(own)
    assert _same(from_reference_layout(ref), own) and _same(to_reference_layout(ref), ref)
    assert _same(from_reference_layout(own), own)
    assert _same(checkpoint_filter_fn(ref, None), own)
    assert _same(checkpoint_filter_fn({'model': {'module.' + k: v for k, v in ref.items()}}, None), own)
    assert ref['layers.0.downsample.norm.running_var'] is own['layers.1.downsample.norm.running_var']


def test_parameter_order_is_the_reference_order():
    """Optimizer state is keyed by parameter position: the model's parameters come in the order of the
    reference layout's keys, so an optimizer state saved by a model of that layout fits."""
    model = _xt(0, num_classes=1000)
    names = list(to_reference_layout({n: p for n, p in model.named_parameters()}))
    params = set(names)
    assert names == [k for k, _, _ in read_keys(KEYS) if k in params]


def test_load_state_dict_takes_either_layout_also_under_a_wrapper():
    src, dst = _xt(1), _xt(2)
    ref = to_reference_layout(src.state_dict())
    dst.load_state_dict(ref, strict=True)
    assert _same(dst.state_dict(), src.state_dict())
    feats = _xt(2, features_only=True)                     # the backbone held as .model
    feats.load_state_dict({f'model.{k}': v for k, v in ref.items() if not k.startswith(('proj', 'norm', 'head'))})
    assert _same(feats.model.state_dict(), {k: v for k, v in src.state_dict().items()
                                            if not k.startswith(('proj', 'norm', 'head'))})


def _load_hub():
    spec = importlib.util.spec_from_file_location('hubconf', os.path.join(REPO, 'hubconf.py'))
    hub = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hub)
    return hub


def test_every_loader_takes_a_reference_layout_checkpoint(tmp_path, one_thread, capsys):
    raw, ema = _xt(1), _xt(2)
    want = ema.state_dict()
    path = str(tmp_path / 'old.pth')
    torch.save({'model': to_reference_layout(raw.state_dict()), 'model_ema': to_reference_layout(want),
                'epoch': 3, 'args': {'model': 'NALAFORMER_XT', 'input_size': 32}}, path)
    timm_loaded = _xt(9)
    timm.models.load_checkpoint(timm_loaded, path, use_ema=True, strict=True)
    finetuned, teacher = _xt(9), _xt(9)
    weights.finetune_from(finetuned, path, 'NALAFORMER_XT')              # main.py --finetune
    weights.load_model_weights(teacher, path, 'NALAFORMER_XT')           # main.py --teacher-path
    loaded = {
        'timm checkpoint_path': timm.create_model('NALAFORMER_XT', num_classes=3, checkpoint_path=path),
        'timm pretrained file': timm.create_model('NALAFORMER_XT', pretrained=True,
                                                  pretrained_cfg_overlay=dict(file=path)),
        'timm load_checkpoint': timm_loaded,
        'hubconf': _load_hub().NALAFORMER_XT(pretrained=True, file=path),
        'analyze_attention': analyze_attention.load_model('NALAFORMER_XT', path)[0],
        'predict': predict.predicting_model('NALAFORMER_XT', predict.load_weights(path)[0], path),
        '--finetune': finetuned, '--teacher-path': teacher,
    }
    args = cli.get_args_parser().parse_args(['--model', 'NALAFORMER_XT', '--output_dir', str(tmp_path / 'run')])
    evaluated = _xt(9)                                                       # main.py --eval --resume
    run = TrainingRun(args, evaluated, None, None, None, None, 7, 'cpu')
    run.resume(path, eval_only=True)
    assert _same(evaluated.state_dict(), raw.state_dict())
    _, ema_sd = weights.select_weights(run.resume(path, eval_only=True).ckpt, path, 'model_ema')
    weights.load_weights_into(evaluated, ema_sd, 'NALAFORMER_XT', path)
    loaded['--eval (EMA)'] = evaluated
    released = release.release(path, str(tmp_path / 'rel'), flops=False)['file']
    loaded['release'] = timm.create_model('NALAFORMER_XT', pretrained=True,
                                          pretrained_cfg_overlay=dict(file=released))
    for name, model in loaded.items():
        assert _same(model.state_dict(), want), name


def _step(model, optimizer, seed):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 3, (4,), generator=g)
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()


def test_training_resumes_bit_exactly_from_a_reference_layout_checkpoint(tmp_path, one_thread, capsys):
    """A checkpoint whose weights have the reference layout (optimizer state keyed by parameter order, with
    layer decay's parameter groups): the resumed run's next step is the uninterrupted run's, bit for bit."""
    args = cli.get_args_parser().parse_args(['--model', 'NALAFORMER_XT', '--layer-decay', '0.75', '--epochs', '4',
                                              '--output_dir', str(tmp_path / 'run')])
    model = _xt(0, drop_path_rate=0.0).train()
    optimizer = optimizer_of(args, model)
    scheduler = scheduler_of(args, optimizer)
    _step(model, optimizer, 1)
    path = str(tmp_path / 'old.pth')
    torch.save({'model': to_reference_layout(model.state_dict()), 'optimizer': optimizer.state_dict(),
                'lr_scheduler': scheduler.state_dict(), 'epoch': 0, 'scaler': None, 'max_accuracy': 0.0,
                'args': checkpoint.args_to_dict(args)}, path)

    resumed = _xt(5, drop_path_rate=0.0).train()
    resumed_opt = optimizer_of(args, resumed)
    run = TrainingRun(args, resumed, None, resumed_opt, scheduler_of(args, resumed_opt),
                                         None, 7, 'cpu')
    assert run.resume(path).start_epoch == 1
    _step(model, optimizer, 2)
    _step(resumed, resumed_opt, 2)
    assert _same(resumed.state_dict(), model.state_dict())
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert all(torch.equal(a, b) for a, b in zip(optimizer.state[p].values(), resumed_opt.state[q].values()))


def test_release_in_the_reference_layout_runs_in_the_reference_code(tmp_path, one_thread, capsys):
    from safetensors.torch import load_file
    model = _xt(4, num_classes=1000).eval()
    path = str(tmp_path / 'best.pth')
    torch.save({'model': model.state_dict(), 'args': {'model': 'NALAFORMER_XT', 'input_size': 32}}, path)
    assert release.main([path, '--output-dir', str(tmp_path / 'rel'), '--reference-layout', '--no-flops']) == 0
    file = next(str(p) for p in (tmp_path / 'rel').iterdir() if p.suffix == '.safetensors')
    assert os.path.basename(file).startswith('nalaformer_xt_32_reference-')
    tensors = load_file(file)
    rows = read_keys(KEYS)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == {k: shape for k, shape, _ in rows}
    with torch.no_grad():
        torch.testing.assert_close(reference_forward(tensors, 'NALAFORMER_XT', X), model(X), rtol=1e-4, atol=1e-5)
        back = timm.create_model('NALAFORMER_XT', pretrained=True, pretrained_cfg_overlay=dict(file=file)).eval()
        torch.testing.assert_close(back(X), model(X), rtol=0, atol=0)
        again = predict.predicting_model('NALAFORMER_XT', predict.load_weights(file)[0], file)
        torch.testing.assert_close(again(X), model(X), rtol=0, atol=0)
    with open(file[:-len('.safetensors')] + '.md') as f:
        assert "Key layout: the reference implementation's" in f.read()
