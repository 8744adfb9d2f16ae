"""Weights into a model (run/weights.py, models/weight_files.py): the one rule by which every single-weights loader
takes its weights, and the one-line diagnosis of files and weights that do not fit the model."""
import fractions
from argparse import Namespace

import pytest
import timm
import torch
from conftest import build_xt, load
from test_checkpoint import _same, _Tiny, _xt

from run import checkpoint, errors, resume, weights
from tools import analyze_attention as aa


# ------------------------------------------------------------------------------------------ one loader rule
@pytest.mark.parametrize('with_ema', [True, False])
def test_every_single_weights_loader_takes_the_same_weights(tmp_path, with_ema, capsys):
    raw, ema = _xt(1), _xt(2)
    ckpt = {'model': raw.state_dict(), 'epoch': 3, 'args': {'input_size': 40, 'model': 'NALAFORMER_XT'}}
    if with_ema:
        ckpt['model_ema'] = {'module.' + k: v for k, v in ema.state_dict().items()}  # a DDP prefix, too
    path = tmp_path / 'best.pth'
    torch.save(ckpt, path)
    want = (ema if with_ema else raw).state_dict()

    key, sd = weights.select_weights(torch.load(path, weights_only=True), str(path))
    assert key == ('model_ema' if with_ema else 'model') and _same(sd, want)
    loaded = {
        'timm checkpoint_path': timm.create_model('NALAFORMER_XT', num_classes=3, checkpoint_path=str(path)),
        'timm pretrained file': timm.create_model('NALAFORMER_XT', num_classes=3, pretrained=True,
                                                  pretrained_cfg_overlay=dict(file=str(path), num_classes=3)),
        'analyze_attention': aa.load_model('NALAFORMER_XT', str(path))[0],
    }
    finetuned = _xt(9)
    weights.finetune_from(finetuned, str(path), 'NALAFORMER_XT')  # main.py --finetune
    teacher = _xt(9)
    weights.load_model_weights(teacher, str(path), 'NALAFORMER_XT')  # main.py --teacher-path
    loaded.update({'--finetune': finetuned, '--teacher-path': teacher})
    for name, model in loaded.items():
        assert _same(model.state_dict(), want), name
    assert aa.load_model('NALAFORMER_XT', str(path))[1]['input_size'] == 40  # args stored as a dict
    assert _same(aa.load_model('NALAFORMER_XT', str(path), weights='model')[0].state_dict(), raw.state_dict())
    # a reference checkpoint stores args as a Namespace: it loads without unpickling anything else
    ckpt['args'] = Namespace(input_size=48)
    torch.save(ckpt, path)
    assert aa.load_model('NALAFORMER_XT', str(path))[1]['input_size'] == 48


def test_a_release_loads_as_weights_and_its_card_values_as_the_recorded_command_line(tmp_path, capsys):
    """tools/release.py's safetensors reaches --finetune, --teacher-path and --eval --resume through the checkpoint
    reader: its weights, and the model, input size and crop ratio it records, which main.py takes as a checkpoint's
    command line; training cannot continue from it (weights only): one line that points to --finetune."""
    from tools import release
    raw, ema = _xt(1), _xt(2)
    path = tmp_path / 'run' / 'checkpoint.pth'
    path.parent.mkdir()
    torch.save({'model': raw.state_dict(), 'model_ema': ema.state_dict(), 'epoch': 3,
                'args': {'input_size': 40, 'model': 'NALAFORMER_XT'}, 'classes': ['a', 'b', 'c']}, path)
    rel = release.release(str(path), str(tmp_path / 'rel'), weights='model_ema', flops=False)['file']
    finetuned, teacher = _xt(9), _xt(9)
    weights.finetune_from(finetuned, rel, 'NALAFORMER_XT')
    weights.load_model_weights(teacher, rel, 'NALAFORMER_XT')
    for model in (finetuned, teacher):
        assert _same(model.state_dict(), ema.state_dict())
    assert f'Finetune: loaded {rel}, a release of model_ema weights (all ' in capsys.readouterr().out
    assert checkpoint.recorded_args(rel) == {'model': 'NALAFORMER_XT', 'input_size': 40, 'eval_crop_ratio': 0.875}
    assert checkpoint.load_checkpoint_file(rel)['classes'] == ['a', 'b', 'c']
    resume.check_resumable(rel, eval_only=True)
    with pytest.raises(errors.CheckpointError) as e:
        resume.check_resumable(rel, eval_only=False)
    assert str(e.value) == (f'--resume {rel} is a release (weights only: no optimizer state, LR schedule or epoch to '
                            f'continue from): start a training run from its weights with --finetune {rel}, or '
                            f'evaluate it with --eval --resume {rel}')


def test_select_weights_errors():
    sd = _Tiny().state_dict()
    with pytest.raises(errors.CheckpointError, match=r'x\.pth has no EMA weights'):
        weights.select_weights({'model': sd}, 'x.pth', 'model_ema')
    with pytest.raises(errors.CheckpointError, match='holds no model weights'):
        weights.select_weights({'epoch': 1}, 'x.pth')
    assert weights.select_weights(sd, 'x.pth') == ('', sd)
    assert weights.select_weights({'model': sd, 'model_ema': None}, 'x.pth')[0] == 'model'


# ------------------------------------------------------------------------------ weights that do not fit
@pytest.fixture(scope='module')
def xt_ckpt(tmp_path_factory):
    p = tmp_path_factory.mktemp('ck') / 'xt.pth'
    torch.save({'model': build_xt(3).state_dict(), 'epoch': 0}, p)
    return p


def test_not_a_checkpoint(tmp_path):
    p = tmp_path / 'notes.pth'
    p.write_text('these are not weights\n')
    with pytest.raises(errors.CheckpointError, match=r'is not a PyTorch checkpoint'):
        weights.load_model_weights(build_xt(), str(p), 'NALAFORMER_XT')


def test_truncated_checkpoint(xt_ckpt, tmp_path):
    p = tmp_path / 'cut.pth'
    p.write_bytes(xt_ckpt.read_bytes()[: xt_ckpt.stat().st_size // 2])
    with pytest.raises(errors.CheckpointError, match=r'truncated or corrupt'):
        weights.load_model_weights(build_xt(), str(p), 'NALAFORMER_XT')


def test_arbitrary_objects_are_never_unpickled(xt_ckpt, tmp_path):
    p = tmp_path / 'obj.pth'
    torch.save({'model': load(xt_ckpt)['model'], 'extra': fractions.Fraction(1, 3)}, p)
    with pytest.raises(errors.CheckpointError, match=r'refusing to unpickle'):
        weights.load_model_weights(build_xt(), str(p), 'NALAFORMER_XT')


def test_checkpoint_of_another_variant_names_it(xt_ckpt):
    import timm
    t = timm.create_model('NALAFORMER_T', num_classes=3)
    with pytest.raises(errors.CheckpointError, match=r'looks like a NALAFORMER_XT checkpoint.*--model NALAFORMER_XT'):
        weights.load_model_weights(t, str(xt_ckpt), 'NALAFORMER_T')


def test_other_number_of_classes_points_to_finetune(xt_ckpt):
    with pytest.raises(errors.CheckpointError, match=r'3-class classifier but the model has 10 classes.*--finetune'):
        weights.load_model_weights(build_xt(10), str(xt_ckpt), 'NALAFORMER_XT')


def test_the_variant_of_a_file_is_guessed_from_its_shapes_without_building_a_model(xt_ckpt, monkeypatch):
    t = timm.create_model('NALAFORMER_T', num_classes=3)
    xt_sd, t_sd = load(xt_ckpt)['model'], t.state_dict()
    monkeypatch.setattr(timm, 'create_model', lambda *a, **k: pytest.fail('a model was built'))
    assert weights.guess_variant(xt_sd) == ('NALAFORMER_XT', 1.0)
    assert weights.guess_variant(t_sd) == ('NALAFORMER_T', 1.0)
    # the blocks decide: the stem, the downsamples and the head are not read
    assert weights.guess_variant({k: v for k, v in t_sd.items() if k.startswith('layers.') and 'downsample' not in k}) \
        == ('NALAFORMER_T', 1.0)
    assert weights.guess_variant(xt_sd, candidates=['NALAFORMER_T', 'NALAFORMER_S'])[1] < 0.5
    assert weights.guess_variant({'fc.weight': torch.zeros(2, 2)}) == (None, 0.0)  # not a NaLaFormer
    with pytest.raises(errors.CheckpointError, match=r'looks like a NALAFORMER_XT checkpoint.*--model NALAFORMER_XT'):
        weights.load_model_weights(t, str(xt_ckpt), 'NALAFORMER_T')
