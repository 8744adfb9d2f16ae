"""tools/predict.py: top-k per image with the checkpoint's evaluation transform."""
import csv
import io
import json

import numpy as np
import pytest
import timm
import torch
from PIL import Image

import datasets
import models  # noqa: F401
from tools import predict, release


def _images(root, n=3):
    rng = np.random.default_rng(0)
    root.mkdir()
    (root / 'sub').mkdir()
    paths = []
    for i in range(n):
        h, w = 40 + 7 * i, 60 - 5 * i
        p = root / ('sub' if i == 0 else '.') / f'img{i}.png'
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(p)
        paths.append(str(p))
    (root / 'notes.txt').write_text('not an image')
    return sorted(paths)


def _checkpoint(tmp_path, input_size=48, crop=0.9, num_classes=4):
    torch.manual_seed(0)
    model = timm.create_model('NALAFORMER_XT', num_classes=num_classes)
    ema = timm.create_model('NALAFORMER_XT', num_classes=num_classes)
    path = tmp_path / 'ckpt.pth'
    torch.save({'model': model.state_dict(), 'model_ema': ema.state_dict(), 'epoch': 0,
                'args': {'model': 'NALAFORMER_XT', 'input_size': input_size, 'eval_crop_ratio': crop}}, path)
    return path, ema


def _expected(ema, paths, input_size, crop, k):
    """Top-k of ``ema`` on ``paths`` through main.py --eval's transform at ``input_size`` and ``crop``."""
    tf = datasets.build_transform(False, datasets.data_config('NALAFORMER_XT', input_size, crop))
    x = torch.stack([tf(Image.open(p).convert('RGB')) for p in paths])
    with torch.no_grad():
        probs = ema.eval()(x).softmax(1)
    return probs.topk(k, dim=1)


def test_an_unrecorded_crop_ratio_is_the_models(tmp_path, one_thread, capsys):
    path, ema = _checkpoint(tmp_path, crop=None)  # main.py's --eval-crop-ratio default: the model's crop_pct
    img = _images(tmp_path / 'imgs', n=1)[0]
    assert predict.main([img, '--checkpoint', str(path), '--format', 'json', '--topk', '2']) == 0
    captured = capsys.readouterr()
    assert '48 px, crop_pct 0.875' in captured.err
    values, _ = _expected(ema, [img], 48, 0.875, 2)
    np.testing.assert_allclose([t['probability'] for t in json.loads(captured.out)[0]['topk']], values[0].numpy(),
                               atol=1e-5)


def test_predict_csv_uses_checkpoint_size_and_ema_weights(tmp_path, one_thread, capsys):
    path, ema = _checkpoint(tmp_path)
    paths = _images(tmp_path / 'imgs')
    out = tmp_path / 'preds.csv'
    assert predict.main([str(tmp_path / 'imgs'), '--checkpoint', str(path), '--topk', '3',
                         '--output', str(out)]) == 0
    assert '48 px, crop_pct 0.9' in capsys.readouterr().err
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    # the folder is searched recursively, sorted, and the .txt file is skipped
    found = list(dict.fromkeys(r['image'] for r in rows))
    assert found == paths  # all three, in sorted order, the .txt file skipped
    values, indices = _expected(ema, found, 48, 0.9, 3)
    for i, img in enumerate(found):
        mine = [r for r in rows if r['image'] == img]
        assert [int(r['rank']) for r in mine] == [1, 2, 3]
        assert [int(r['class_index']) for r in mine] == indices[i].tolist()
        np.testing.assert_allclose([float(r['probability']) for r in mine], values[i].numpy(), atol=1e-5)


def test_predict_json_with_class_names_from_a_release(tmp_path, one_thread, capsys):
    path, ema = _checkpoint(tmp_path)
    img = _images(tmp_path / 'imgs', n=1)[0]
    info = release.release(str(path), str(tmp_path / 'rel'), flops=False)
    names = tmp_path / 'classes.txt'
    names.write_text('cat\ndog\nfox\nowl\n')
    assert predict.main([img, '--checkpoint', info['file'], '--format', 'json', '--class-names', str(names),
                         '--topk', '9']) == 0
    out = json.loads(capsys.readouterr().out)
    values, indices = _expected(ema, [img], 48, 0.9, 4)  # the release records size and crop; top-k capped at 4
    assert out[0]['image'] == img
    assert [t['class_name'] for t in out[0]['topk']] == [['cat', 'dog', 'fox', 'owl'][i] for i in indices[0]]
    np.testing.assert_allclose([t['probability'] for t in out[0]['topk']], values[0].numpy(), atol=1e-5)


@pytest.mark.parametrize('case', ['bad_image', 'class_count', 'missing'])
def test_bad_input_is_a_one_line_error(tmp_path, capsys, case):
    path, _ = _checkpoint(tmp_path)
    img = _images(tmp_path / 'imgs', n=1)[0]
    argv = [img, '--checkpoint', str(path), '--output', str(tmp_path / 'out.csv')]
    if case == 'bad_image':
        bad = tmp_path / 'broken.png'
        bad.write_bytes(b'not a png')
        argv[0:1] = [img, str(bad)]
        expect = 'broken.png'
    elif case == 'class_count':
        (tmp_path / 'c.txt').write_text('a\nb\n')
        argv += ['--class-names', str(tmp_path / 'c.txt')]
        expect = '2 names but the model has 4 classes'
    else:
        argv[0] = str(tmp_path / 'nope.jpg')
        expect = 'nope.jpg: no such file'
    with pytest.raises(SystemExit) as e:
        predict.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expect in err[0]
    assert not (tmp_path / 'out.csv').exists()


def test_an_image_named_twice_is_predicted_once(tmp_path, one_thread, capsys):
    """A file and the folder holding it (and a link to the file) name one image: one prediction, in the order
    of its first mention."""
    path, _ = _checkpoint(tmp_path, input_size=32)
    paths = _images(tmp_path / 'imgs', n=2)
    link = tmp_path / 'link.png'
    link.symlink_to(paths[1])
    assert predict.main([paths[1], str(tmp_path / 'imgs'), str(link), '--checkpoint', str(path), '--topk', '1']) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [r['image'] for r in rows] == [paths[1], paths[0]]
    assert predict.list_images([paths[0], paths[0]]) == [paths[0]]


def test_another_input_size_than_the_recorded_one_is_noted(tmp_path, one_thread, capsys):
    path, _ = _checkpoint(tmp_path, input_size=48)
    img = _images(tmp_path / 'imgs', n=1)[0]
    assert predict.main([img, '--checkpoint', str(path), '--input-size', '32']) == 0
    err = capsys.readouterr().err
    assert f'Note: --input-size 32 on the command line, 48 in {path}; using 32' in err and 'at 32 px' in err


def test_class_names_are_the_checkpoints_and_a_releases_unless_given(tmp_path, one_thread, capsys):
    """A checkpoint that records its classes (main.py saves the training folders in label order) predicts their
    names, and so does its release; --class-names overrides them."""
    path, ema = _checkpoint(tmp_path)
    ckpt = torch.load(path, weights_only=True)
    ckpt['classes'] = ['cat', 'dog', 'fox', 'owl']
    torch.save(ckpt, path)
    img = _images(tmp_path / 'imgs', n=1)[0]
    _, indices = _expected(ema, [img], 48, 0.9, 4)
    released = release.release(str(path), str(tmp_path / 'rel'), flops=False)['file']
    (tmp_path / 'c.txt').write_text('a\nb\nc\nd\n')
    for source, extra, names in ((path, [], 'cat dog fox owl'), (released, [], 'cat dog fox owl'),
                                 (path, ['--class-names', str(tmp_path / 'c.txt')], 'a b c d')):
        assert predict.main([img, '--checkpoint', str(source), '--topk', '4', *extra]) == 0
        captured = capsys.readouterr()
        rows = list(csv.DictReader(io.StringIO(captured.out)))
        assert [r['class_name'] for r in rows] == [names.split()[i] for i in indices[0]]
        assert ('class names: --class-names' if extra else f'class names: recorded in {source}') in captured.err
