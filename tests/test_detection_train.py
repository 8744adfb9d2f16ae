"""detection/train.py in this process: its flags and one-line errors, the recipe it takes and its overrides, a short
run's files (args.json, log.txt with COCOeval's figures, best.pth by box AP), --eval with the flags its checkpoint
records, --show-dir, other tasks' checkpoints, the size check and where a relaunch on other epochs continues."""
import json
import os
import re
import signal

import numpy as np
import pytest
import torch
from PIL import Image

from detection import shapes
from detection import train as det_train
from detection.model import RECIPES

pytestmark = pytest.mark.usefixtures('one_thread')

#: a short run: the demo recipe on a 12-image set, 2 epochs of 3 steps
ARGS = ['--recipe', 'demo', '--model', 'NALAFORMER_XT', '--epochs', '2', '--warmup-iters', '2', '--print-freq', '2',
        '--device', 'cpu', '--cpu-malloc', 'system', '--num_workers', '0']


def _run(argv):
    """detection/train.py's run() in this process, the signal handlers it installs put back."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    try:
        return det_train.run(argv)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


@pytest.fixture(scope='module')
def data(tmp_path_factory):
    return shapes.make_shapes(str(tmp_path_factory.mktemp('shapes')), n_train=12, n_val=4, seed=2)


@pytest.fixture(scope='module')
def trained(data, tmp_path_factory):
    out = str(tmp_path_factory.mktemp('run') / 'out')
    import contextlib
    import io
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        code = _run([*ARGS, '--lr-steps', '1', '--data-path', data, '--output_dir', out])
    assert code == 0, text.getvalue()[-3000:]
    return out, text.getvalue()


def records(out):
    return [json.loads(line) for line in open(os.path.join(out, 'log.txt'))]


def test_a_run_writes_args_json_a_log_line_per_epoch_and_best_by_box_ap(trained):
    out, stdout = trained
    args = json.load(open(os.path.join(out, 'args.json')))
    assert (args['recipe'], args['model'], args['mask'], args['num_classes']) == ('demo', 'NALAFORMER_XT', True, 3)
    assert (args['lr'], args['lr_steps'], args['batch_size'], args['epochs']) == (1e-3, [1], 4, 2)
    log = records(out)
    assert [(r['epoch'], r['iter']) for r in log] == [(1, 3), (2, 6)]
    assert all({'box_AP', 'box_AP50', 'box_APl', 'mask_AP', 'mask_APs', 'train_loss', 'lr'} <= set(r) for r in log)
    best = torch.load(os.path.join(out, 'best.pth'), map_location='cpu', weights_only=False)
    top = max(log, key=lambda r: r['box_AP'])
    assert best['iter'] == top['iter'] and best['best_box_ap'] == top['box_AP'] and best['task'] == 'detection'
    last = torch.load(os.path.join(out, 'checkpoint.pth'), map_location='cpu', weights_only=False)
    assert last['iter'] == 6 and last['steps_per_epoch'] == 3 and not last['eval_due']
    assert len(re.findall(r'^Epoch \d \(iteration \d\): box AP \d+\.\d  mask AP \d+\.\d$', stdout, re.M)) == 2
    assert 'Evaluating bbox:' in stdout and 'Evaluating segm:' in stdout
    assert 'Warning: global batch 4' not in stdout  # the demo recipe's own batch
    assert re.search(r'^Training done: box AP \d+\.\d at the last iteration \(6\), best box AP', stdout, re.M)


def test_the_lr_follows_the_recipe_with_the_command_lines_overrides(trained):
    out, _ = trained
    log = records(out)
    recipe = RECIPES['demo']
    assert log[0]['lr'] == pytest.approx(recipe.lr)  # iteration 2: past the 2-iteration warmup, in epoch 0
    assert log[1]['lr'] == pytest.approx(recipe.lr * recipe.gamma)  # --lr-steps 1: x0.1 from epoch 1 on


def test_eval_takes_the_recorded_flags_and_scores_as_the_last_evaluation(trained, data, capsys, tmp_path):
    out, _ = trained
    show = str(tmp_path / 'show')
    code = _run(['--eval', '--resume', os.path.join(out, 'checkpoint.pth'), '--data-path', data, '--device', 'cpu',
                 '--num_workers', '0', '--show-dir', show])
    stdout = capsys.readouterr().out
    assert code == 0, stdout[-3000:]
    assert '--model NALAFORMER_XT --recipe demo: as recorded in' in stdout
    last = records(out)[-1]
    line = f"box AP {last['box_AP']:.1f}  mask AP {last['mask_AP']:.1f}"
    assert re.findall(r'^box AP .*$', stdout, re.M) == [line]
    names = sorted(os.listdir(show))
    val = sorted(os.listdir(os.path.join(data, 'val2017')))
    assert names == [v.replace('.jpg', '.png') for v in val]
    for name, image in zip(names, val):
        drawn, original = Image.open(os.path.join(show, name)), Image.open(os.path.join(data, 'val2017', image))
        assert drawn.size == original.size


def test_a_model_flag_other_than_the_checkpoints_is_one_line(trained, data, capsys):
    out, _ = trained
    code = _run(['--eval', '--resume', os.path.join(out, 'checkpoint.pth'), '--data-path', data, '--device', 'cpu',
                 '--recipe', '1x'])
    err = capsys.readouterr().err
    assert code == 1 and re.search(r'holds a model built with --recipe demo, this command passes --recipe 1x', err)


def test_other_tasks_checkpoints_name_the_script_that_takes_them(trained, data, capsys, tmp_path):
    from conftest import REPO
    seg = os.path.join(REPO, 'tests', 'fixtures', 'segmentation_checkpoint.pth')
    code = _run(['--eval', '--resume', seg, '--data-path', data, '--device', 'cpu'])
    err = capsys.readouterr().err
    assert code == 1 and 'is a segmentation checkpoint (written by segmentation/train.py), not a detection one' in err
    cls = os.path.join(REPO, 'tests', 'fixtures', 'classification_checkpoint.pth')
    code = _run(['--eval', '--resume', cls, '--data-path', data, '--device', 'cpu'])
    err = capsys.readouterr().err
    assert code == 1 and f'--pretrained {cls}' in err and 'is not a detection checkpoint' in err
    from run.checkpoint import refuse_other_task
    from run.errors import FlagError
    with pytest.raises(FlagError, match=r'is a detection checkpoint \(written by detection/train.py\).*--eval'):
        refuse_other_task('--resume', os.path.join(trained[0], 'checkpoint.pth'))


@pytest.mark.parametrize('argv, error', [
    (['--show-dir', 'x'], '--show-dir x: draws the predictions of a checkpoint; use it with --eval'),
    (['--model', 'nalaformer-t'], 'NALAFORMER_T'),
    (['--recipe', '2x'], "invalid choice: '2x'"),
])
def test_flag_mistakes_are_argparse_lines(argv, error, data, capsys):
    with pytest.raises(SystemExit) as e:
        _run([*argv, '--data-path', data, '--device', 'cpu'])
    assert e.value.code == 2 and error in capsys.readouterr().err


def test_train_and_val_files_of_other_categories_are_one_line(data, tmp_path, capsys):
    import shutil
    copy = str(tmp_path / 'coco')
    shutil.copytree(data, copy)
    path = os.path.join(copy, 'annotations', 'instances_val2017.json')
    val = json.load(open(path))
    val['categories'].append({'id': 40, 'name': 'star', 'supercategory': 'shape'})
    json.dump(val, open(path, 'w'))
    code = _run([*ARGS, '--data-path', copy, '--output_dir', str(tmp_path / 'out')])
    err = capsys.readouterr().err
    assert code == 1 and re.search(r'instances_train2017.json and .*instances_val2017.json list other categories', err)


def test_a_batch_that_cannot_fit_is_refused_naming_one_that_does(data, monkeypatch, capsys):
    import cli
    monkeypatch.setattr(cli, 'device_memory', lambda device: (16 * 2 ** 30, 'the 16 GiB of this GPU'))
    code = _run(['--model', 'NALAFORMER_T', '--batch-size', '64', '--data-path', data, '--device', 'cpu'])
    err = capsys.readouterr().err
    assert code == 2
    m = re.search(r'--batch-size 64: one training batch of --recipe 1x needs at least .* use --batch-size (\d+)', err)
    assert m and 0 < int(m.group(1)) < 64, err
    args = det_train.get_args_parser().parse_args(['--data-path', data, '--batch-size', m.group(1)])
    recipe = det_train.take_flags(args, '')
    det_train.check_sizes(args, recipe, torch.device('cpu'))  # the batch it names fits


def test_the_recipe_defaults_and_overrides():
    args = det_train.get_args_parser().parse_args(['--data-path', 'x', '--recipe', '3x', '--lr', '2e-4'])
    recipe = det_train.take_flags(args, '')
    assert (recipe.epochs, recipe.lr_steps, recipe.lr, recipe.weight_decay) == (36, (27, 33), 2e-4, 0.05)
    assert (args.model, args.mask, args.batch_size) == ('NALAFORMER_T', True, 2)


def test_a_relaunch_with_epochs_of_another_length_continues_at_the_same_point_of_the_epoch():
    assert det_train.same_point_of_epoch(10, 4, 2) == 5  # epoch 2, half done: 2 x 2 + 1
    assert det_train.same_point_of_epoch(8, 4, 8) == 16  # an epoch's end stays one
    assert det_train.same_point_of_epoch(7, 4, 2) == 4  # 3 of 4 steps: 1.5 of 2, rounded half to even
    assert all(det_train.same_point_of_epoch(it, 5, 5) == it for it in range(20))


def test_a_training_image_of_another_size_than_its_annotation_ends_the_run_in_one_line(data, tmp_path, capsys):
    import shutil
    copy = str(tmp_path / 'coco')
    shutil.copytree(data, copy)
    train = sorted(os.listdir(os.path.join(copy, 'train2017')))
    for name in train:
        Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(os.path.join(copy, 'train2017', name))
    code = _run([*ARGS, '--data-path', copy, '--output_dir', str(tmp_path / 'out')])
    err = capsys.readouterr().err
    assert code == 1 and re.search(r'the image is 4x4 but .* says', err), err


def test_train_sh_runs_dry_and_its_command_parses_to_the_recipe():
    import subprocess

    from conftest import REPO, env
    p = subprocess.run(['bash', os.path.join(REPO, 'detection', 'train.sh'), '--no-mask'],
                       env={**env(), 'DRY_RUN': '1', 'PRETRAINED': 'ck.pth', 'RECIPE': 'pvt-1x'}, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    words = p.stdout.strip().splitlines()[-1].split()
    args = det_train.get_args_parser().parse_args(words[words.index('detection/train.py') + 1:])
    recipe = det_train.take_flags(args, '')
    assert (recipe.name, args.batch_size, args.pretrained, args.mask, args.dist_eval) == ('pvt-1x', 2, 'ck.pth',
                                                                                         False, True)
    assert '--nproc_per_node=8' in words and args.output_dir == 'output/det_NALAFORMER_T_pvt-1x'
    p = subprocess.run(['bash', os.path.join(REPO, 'slurm', 'train.sbatch')], cwd=REPO, capture_output=True, text=True,
                       env={**env(), 'DRY_RUN': '1', 'SCRIPT': 'detection/train.sh'}, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    srun, node = [line for line in p.stdout.splitlines() if line.startswith('+ ')]
    assert srun.endswith('detection/train.sh') and ' detection/train.py --model ' in node


@pytest.fixture(scope='module')
def two(tmp_path_factory):
    """Two annotated training images (one step of batch 2) and one validation image."""
    root = shapes.make_shapes(str(tmp_path_factory.mktemp('two')), n_train=3, n_val=1, seed=4)
    path = os.path.join(root, 'annotations', 'instances_train2017.json')
    data = json.load(open(path))
    annotated = sorted({a['image_id'] for a in data['annotations'] if not a.get('iscrowd')})[:2]
    data['images'] = [i for i in data['images'] if i['id'] in annotated]
    data['annotations'] = [a for a in data['annotations'] if a['image_id'] in annotated]
    json.dump(data, open(path, 'w'))
    return root


@pytest.mark.slow  # three backbones of about 28M parameters
@pytest.mark.parametrize('peer', ['convnext_tiny', 'pvt_v2_b2', 'swin_tiny_patch4_window7_224'])
def test_the_control_peers_train_and_evaluate_through_the_same_code(peer, two, tmp_path, capsys):
    out = str(tmp_path / 'out')
    code = _run(['--recipe', 'demo', '--model', peer, '--epochs', '1', '--batch-size', '2', '--device', 'cpu',
                 '--cpu-malloc', 'system', '--num_workers', '0', '--data-path', two, '--output_dir', out])
    stdout = capsys.readouterr().out
    assert code == 0, stdout[-3000:]
    assert f'Model: Mask R-CNN with FPN over {peer}, recipe demo' in stdout
    (record,) = records(out)
    assert record['iter'] == 1 and record['images'] == 1 and 'mask_AP' in record
    assert json.load(open(os.path.join(out, 'args.json')))['model'] == peer
