"""A user's path end to end: train (a real main.py process) with --layer-decay and --log-dir, then release
the checkpoint and predict with the release and with the checkpoint."""
import csv
import io
import json
import os

import pytest
from conftest import BASE, run_main
from helpers.image_folders import make_imagefolder

from tools import predict, release

pytestmark = pytest.mark.slow  # trains in a real main.py process


def test_train_log_release_predict(tmp_path, capsys):
    pytest.importorskip('tensorboard', reason='optional: pip install -r requirements-optional.txt')
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    data = make_imagefolder(tmp_path / 'data', classes=3, n_train=4, n_val=2)
    out, tb = str(tmp_path / 'out'), str(tmp_path / 'tb')
    run_main(BASE[:-1] + ['1', '--data-path', data, '--output_dir', out, '--log-dir', tb, '--layer-decay', '0.7',
                          '--num_workers', '0', '--no-model-ema'])
    with open(os.path.join(out, 'log.txt')) as f:
        log = json.loads(f.readline())
    acc = EventAccumulator(tb)
    acc.Reload()
    assert [e.step for e in acc.Scalars('train/loss')] == [0, 1, 2]  # 12 images / batch 4
    assert acc.Scalars('train/lr')[0].value == pytest.approx(log['train_lr'])
    assert acc.Scalars('epoch/test_acc1')[0].value == pytest.approx(log['test_acc1'])

    ckpt = os.path.join(out, 'checkpoint.pth')
    info = release.release(ckpt, str(tmp_path / 'rel'), flops=False)
    assert os.path.basename(info['file']).startswith('nalaformer_xt_32-') and info['weights'] == 'model'
    rows = []
    for path in (info['file'], ckpt):
        assert predict.main([os.path.join(data, 'val'), '--checkpoint', path, '--topk', '2']) == 0
        captured = capsys.readouterr()
        assert '6 image(s) at 32 px' in captured.err
        rows.append(list(csv.DictReader(io.StringIO(captured.out))))
    assert len(rows[0]) == 12 and rows[0] == rows[1]
