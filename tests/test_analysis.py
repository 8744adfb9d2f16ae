"""Numbers of tools/analyze_attention.py (with its attention rules, tools/attention_rules.py) and tools/plot_log.py
against hand-computed cases."""
import json
import math
import os
from argparse import Namespace

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F

import datasets
import models  # noqa: F401
from models.nala import RoPE, nala_attention_plain, nala_kernel_terms, softmax_attention_plain
from run import errors
from tools import analyze_attention as aa
from tools import attention_rules as rules
from tools import plot_log as pl


# ------------------------------------------------------------------------------------ entropy
def test_entropy_hand_cases():
    n = 7
    assert rules.entropy(torch.full((n,), 1 / n)).item() == pytest.approx(math.log(n), abs=1e-6)
    assert rules.entropy(F.one_hot(torch.tensor(3), 5).float()).item() == 0.0
    assert rules.entropy(torch.tensor([0.5, 0.25, 0.25, 0.0])).item() == pytest.approx(1.5 * math.log(2), abs=1e-6)


def test_zero_rows_are_excluded_not_uniform():
    rows, valid = rules.normalise_rows(torch.tensor([[1.0, 3.0], [0.0, 0.0]]))
    assert valid.tolist() == [True, False]
    assert rows.tolist() == [[0.25, 0.75], [0.0, 0.0]]
    # ReLU attention: an all-negative query has no distribution at all
    _, valid = rules.relu_rows(torch.tensor([[-1.0, -2.0], [1.0, 0.0]]), torch.tensor([[1.0, 1.0], [2.0, 0.0]]))
    assert valid.tolist() == [False, True]


def test_nala_rows_hand_case():
    """d = 2, keys cube to 1, 8, -1 on channel 0. A positive query sees only the positive keys
    (1 : 8), a negative query only the negative one (one-hot): opposite signs are inhibited."""
    k = torch.tensor([[1.0, 0.0], [2.0, 0.0], [-1.0, 0.0]])
    q = torch.tensor([[1.0, 0.0], [-2.0, 0.0]])
    rows, valid = rules.nala_rows(q, k)
    assert valid.all()
    torch.testing.assert_close(rows, torch.tensor([[1 / 9, 8 / 9, 0.0], [0.0, 0.0, 1.0]]))
    ent = rules.entropy(rows)
    assert ent[0].item() == pytest.approx(-(1 / 9) * math.log(1 / 9) - (8 / 9) * math.log(8 / 9), abs=1e-6)
    assert ent[1].item() == 0.0


def test_nala_rows_equal_explicit_pairwise_kernel():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 3, 9, 8, generator=g), torch.randn(2, 3, 9, 8, generator=g)
    rows, _ = rules.nala_rows(q, k)
    qf, kf = nala_kernel_terms(q, k)
    for b in range(2):
        for h in range(3):
            for i in range(9):
                s = torch.stack([qf[b, h, i] @ kf[b, h, j] for j in range(9)])
                torch.testing.assert_close(rows[b, h, i], s / s.sum())


def test_model_weights_reproduce_the_attention_cores():
    """The N x N weights the map uses, applied to v, give the model's own NaLa / softmax output."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 20, 8, generator=g) for _ in range(3))
    sin, cos = RoPE(16, 2)((4, 5))
    torch.testing.assert_close(rules.nala_model_weights(q, k, sin, cos) @ v, nala_attention_plain(q, k, v, sin, cos),
                               rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(rules.softmax_model_weights(q, k, sin, cos) @ v,
                               softmax_attention_plain(q, k, v, sin, cos), rtol=1e-4, atol=1e-5)
    # without RoPE the model's NaLa weights are the tool's rows (up to the 1e-6 in the normaliser)
    ones, zeros = torch.ones(20, 8), torch.zeros(20, 8)
    torch.testing.assert_close(rules.nala_model_weights(q, k, zeros, ones), rules.nala_rows(q, k)[0],
                               rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------- correlations
def test_rank_and_correlations():
    assert rules.rankdata(np.array([3.0, 1.0, 2.0, 2.0])).tolist() == [4.0, 1.0, 2.5, 2.5]
    x = np.linspace(0.1, 2, 30)
    assert rules.pearson(x, -2 * x + 1) == pytest.approx(-1.0)
    assert rules.spearman(x, x ** 3) == pytest.approx(1.0)
    assert rules.pearson(x, np.ones_like(x)) != rules.pearson(x, np.ones_like(x))  # NaN for a constant
    assert rules.pearson([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    scipy_stats = pytest.importorskip('scipy.stats')
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 5, 50).astype(float), rng.normal(size=50)
    assert rules.spearman(a, b) == pytest.approx(scipy_stats.spearmanr(a, b).statistic)


def test_constructed_case_signs():
    """One query direction u = (0.8, 0.6) at growing norms; key 0 on channel 0, keys 1-3 on channel 1.
    NaLa's power 3(0.5 + tanh n) and softmax's temperature both favour key 0 more as n grows, so the
    entropy falls strictly (Spearman -1); ReLU linear attention and NaLa with p fixed are scale
    invariant: constant entropy."""
    norms = torch.tensor([0.1, 0.3, 0.6, 1.0, 1.5, 2.0])
    q = (norms[:, None] * torch.tensor([0.8, 0.6]))[None, None]           # (1, 1, 6, 2)
    k = torch.tensor([[1.0, 0.0]] + [[0.0, 1.0]] * 5)[None, None]
    captured = {(0, 0): {'q': q, 'k': k, 'hw': (2, 3), 'sin': None, 'cos': None}}
    res = aa.analyse_stage(captured, 0)
    np.testing.assert_allclose(res['_arrays']['norm'], norms.numpy(), rtol=1e-6)
    for m in ('nala', 'softmax'):
        assert res['methods'][m]['spearman'] == pytest.approx(-1.0)
        assert res['methods'][m]['pearson'] < -0.8
        assert res['methods'][m]['within_layer_spearman'] == pytest.approx(-1.0)
    ent = res['_arrays']['nala_p45']                    # NaLa without its norm: same direction, same row
    np.testing.assert_allclose(ent, ent[0], rtol=0, atol=1e-5)
    assert ent[0] < res['_arrays']['nala'][-1]           # and sharper than at any norm below 10
    ent = res['_arrays']['relu']
    np.testing.assert_allclose(ent, ent[0], rtol=0, atol=1e-6)
    # relu rows: 0.8 : 0.6 x5, by hand
    p = np.array([0.8] + [0.6] * 5) / (0.8 + 3.0)
    assert ent[0] == pytest.approx(-(p * np.log(p)).sum(), abs=1e-6)
    assert math.isnan(res['methods']['relu']['pearson'])
    assert res['log_n'] == pytest.approx(math.log(6))


# ------------------------------------------------------------------------------- model hooks
@pytest.fixture(scope='module')
def tiny_model():
    torch.manual_seed(0)
    return timm.create_model('NALAFORMER_XT', num_classes=10).eval()


@pytest.fixture(scope='module')
def images():
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))


def test_hooks_capture_the_layers_q_and_k(tiny_model, images):
    captured = aa.capture(tiny_model, images, batch_size=1)
    assert sorted(captured) == [(s, b) for s in range(4) for b in range(2)]
    with torch.no_grad():                                        # stage 1, block 0 (2 heads) by hand
        x = tiny_model.layers[1].downsample(tiny_model.layers[0](tiny_model.patch_embed(images)))
        block = tiny_model.layers[1].blocks[0]
        x = x + block.cpe1(x)
        tokens = block.norm1(x.permute(0, 2, 3, 1)).flatten(1, 2)
        q, k = block.attn.qkvg(tokens).chunk(4, dim=-1)[:2]
    rec = captured[(1, 0)]
    assert rec['hw'] == (4, 4) and rec['q'].shape == (2, 2, 16, 32)
    torch.testing.assert_close(rec['q'][:, 1], q[..., 32:64], rtol=1e-4, atol=1e-5)   # head 1 = channels 32..63
    torch.testing.assert_close(rec['k'][:, 0], k[..., :32], rtol=1e-4, atol=1e-5)
    assert aa.stage_kind(tiny_model, 1) == 'nala' and aa.stage_kind(tiny_model, 2) == 'softmax'
    # hooks are removed afterwards
    assert not block.attn.qkvg._forward_hooks
    sin, cos = tiny_model.layers[1].RoPE((4, 4))
    torch.testing.assert_close(rec['sin'], sin)
    # both paths (the default fast one and the plain one) hand over the same q, k
    plain = timm.create_model('NALAFORMER_XT', num_classes=10).eval()
    plain.load_state_dict(tiny_model.state_dict())
    plain.set_fast_path(False)
    other = aa.capture(plain, images)
    for key in captured:
        assert other[key]['hw'] == captured[key]['hw']
        torch.testing.assert_close(other[key]['q'], captured[key]['q'], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(other[key]['k'], captured[key]['k'], rtol=1e-4, atol=1e-5)


def test_stage_entropies_equal_explicit_computation(tiny_model, images):
    captured = aa.capture(tiny_model, images)
    res = aa.analyse_stage(captured, 0)
    expected, norms = [], []
    for b in (0, 1):
        q, k = captured[(0, b)]['q'], captured[(0, b)]['k']
        qf, kf = nala_kernel_terms(q, k)
        scores = torch.einsum('bhid,bhjd->bhij', qf, kf)
        p = scores / scores.sum(-1, keepdim=True)
        expected.append((-(p * torch.log(p.clamp_min(1e-30))).sum(-1)).ravel())
        norms.append(q.norm(dim=-1).ravel())
    np.testing.assert_allclose(res['_arrays']['nala'], torch.cat(expected).numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(res['_arrays']['norm'], torch.cat(norms).numpy(), rtol=1e-6)
    x, y = torch.cat(norms).numpy(), torch.cat(expected).numpy()
    assert res['methods']['nala']['pearson'] == pytest.approx(np.corrcoef(x, y)[0, 1], abs=1e-6)
    assert res['n_tokens'] == 64 and res['methods']['nala']['n_queries'] == 2 * 2 * 64


def test_query_token_and_maps(tiny_model, images):
    assert aa.query_token((4, 5), (0.5, 0.5)) == 2 * 5 + 2
    assert aa.query_token((4, 5), (1.0, 1.0)) == 19
    captured = aa.capture(tiny_model, images)
    kinds = {s: aa.stage_kind(tiny_model, s) for s in range(4)}
    maps = aa.attention_maps(captured, kinds, 1, (0.0, 0.0))
    assert [m['hw'] for m in maps] == [(8, 8), (4, 4), (2, 2), (1, 1)]
    rows = rules.softmax_rows(captured[(2, 1)]['q'][1], captured[(2, 1)]['k'][1])[0][:, 0]   # token 0
    torch.testing.assert_close(maps[2]['weights'].ravel(), rows.mean(0))
    for m in maps:
        assert m['weights'].sum().item() == pytest.approx(1.0, abs=1e-5)


# ----------------------------------------------------------------------------------------- CLI
def _write_images(folder, n=3):
    from PIL import Image
    sub = folder / 'nested'
    sub.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(sub / f'{i}.png')
    (folder / 'notes.txt').write_text('not an image')


def test_cli_with_checkpoint_and_images(tmp_path, capsys):
    torch.manual_seed(5)
    model = timm.create_model('NALAFORMER_XT', num_classes=10)
    ckpt = tmp_path / 'checkpoint.pth'
    torch.save({'model': model.state_dict(), 'args': Namespace(input_size=32, data_set='DIGITS'), 'epoch': 2}, ckpt)
    _write_images(tmp_path / 'imgs')
    out = tmp_path / 'out'
    res = aa.main(['--model', 'NALAFORMER_XT', '--checkpoint', str(ckpt), '--images', str(tmp_path / 'imgs'),
                   '--stage', '1', '--attention-map', '--output-dir', str(out)])
    assert res['input_size'] == 32 and res['n_images'] == 3 and res['n_tokens'] == 16
    for name in ('entropy_stage1.png', 'entropy_stage1.json', 'attention_map.png'):
        assert (out / name).stat().st_size > 0
    saved = json.loads((out / 'entropy_stage1.json').read_text())
    assert saved['methods']['softmax']['pearson'] == pytest.approx(res['methods']['softmax']['pearson'])
    # the printed table carries the JSON's numbers
    printed = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()
               if line.split() and line.split()[0] in rules.METHODS}
    for m in rules.METHODS:
        s = saved['methods'][m]
        assert [float(v) for v in printed[m][:5]] == pytest.approx(
            [s['pearson'], s['spearman'], s['within_layer_pearson'], s['within_layer_spearman'],
             s['mean_entropy']], abs=6e-4)
        assert int(printed[m][5]) == s['n_queries'] == 3 * 2 * 2 * 16
    # the weights analysed are the checkpoint's
    loaded, meta = aa.load_model('NALAFORMER_XT', str(ckpt))
    assert meta['input_size'] == 32 and loaded.head.weight.shape[0] == 10
    torch.testing.assert_close(loaded.layers[0].blocks[0].attn.qkvg.weight, model.layers[0].blocks[0].attn.qkvg.weight)
    with pytest.raises(errors.CheckpointError, match='model_ema'):
        aa.load_model('NALAFORMER_XT', str(ckpt), weights='model_ema')


def test_images_get_main_evals_transform_at_the_checkpoints_size_and_crop(tmp_path):
    from PIL import Image
    model = timm.create_model('NALAFORMER_XT', num_classes=10)
    ckpt = tmp_path / 'checkpoint.pth'
    torch.save({'model': model.state_dict(), 'args': {'input_size': 48, 'eval_crop_ratio': 0.9}}, ckpt)
    _, meta = aa.load_model('NALAFORMER_XT', str(ckpt))
    assert (meta['input_size'], meta['crop_pct']) == (48, 0.9)
    _write_images(tmp_path / 'imgs')
    cfg = datasets.data_config(model, meta['input_size'], meta['crop_pct'])
    got = aa.images_from_dir(str(tmp_path / 'imgs'), cfg, 2)
    main_eval = datasets.build_transform(False, datasets.data_config('NALAFORMER_XT', 48, 0.9))
    paths = sorted(str(p) for p in (tmp_path / 'imgs').rglob('*.png'))[:2]
    assert got.shape == (2, 3, 48, 48)
    assert torch.equal(got, torch.stack([main_eval(Image.open(p).convert('RGB')) for p in paths]))
    # to_display undoes the normalisation: the centre crop of the 53 px resize, in [0, 1]
    shown = aa.to_display(got[0], cfg)
    assert shown.shape == (48, 48, 3) and shown.min() >= 0 and shown.max() <= 1
    np.testing.assert_allclose(shown, got[0].permute(1, 2, 0).numpy() * np.array(cfg['std']) + cfg['mean'], atol=1e-6)


def test_cli_digits_smoke(tmp_path):
    res = aa.main(['--data-set', 'DIGITS', '--data-path', str(tmp_path / 'digits'), '--input-size', '32',
                   '--num-images', '2', '--output-dir', str(tmp_path / 'out')])
    assert res['n_images'] == 2 and res['kind'] == 'nala' and res['hw'] == [8, 8]
    assert all(res['methods'][m]['n_queries'] + res['methods'][m]['n_excluded'] == 2 * 2 * 64 for m in rules.METHODS)
    assert (tmp_path / 'out' / 'entropy_stage0.png').stat().st_size > 0


# ------------------------------------------------------------------------------------ plot_log
LOG = [
    {'train_lr': 1e-06, 'train_loss': 2.30, 'test_loss': 2.25, 'test_acc1': 11.0, 'test_acc5': 50.0,
     'epoch': 0, 'n_parameters': 5000, 'test_ema_acc1': 10.0},
    {'train_lr': 0.0005, 'train_loss': 1.50, 'test_loss': 1.20, 'test_acc1': 60.5, 'test_acc5': 90.0,
     'epoch': 1, 'n_parameters': 5000, 'test_ema_acc1': 12.5},
    {'train_lr': 0.00025, 'train_loss': 0.70, 'test_loss': 0.65, 'test_acc1': 88.25, 'test_acc5': 99.0,
     'epoch': 2, 'n_parameters': 5000, 'test_ema_acc1': 20.0},
]


def _write_log(folder, records, extra=''):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / 'log.txt').write_text(''.join(json.dumps(r) + '\n' for r in records) + extra)
    return folder


def test_plot_log_series_match_the_log(tmp_path):
    a = _write_log(tmp_path / 'a' / 'run', LOG, extra='\n')
    b = _write_log(tmp_path / 'b' / 'run', [{k: v for k, v in r.items() if k != 'test_ema_acc1'} for r in LOG[:2]])
    assert pl.read_log(str(a)) == LOG
    assert pl.series(LOG, 'test_acc1') == ([0.0, 1.0, 2.0], [11.0, 60.5, 88.25])
    labels = pl.run_labels([str(a), str(b)])
    assert labels == ['a/run', 'b/run'] or labels == [os.path.join('a', 'run'), os.path.join('b', 'run')]
    fig = pl.plot_runs([(labels[0], pl.read_log(str(a))), (labels[1], pl.read_log(str(b)))])
    lines = {line.get_gid(): line for ax in fig.axes for line in ax.get_lines() if line.get_gid()}
    for key in ('train_loss', 'test_loss', 'train_lr', 'test_acc1', 'test_ema_acc1'):
        line = lines[f'{labels[0]}|{key}']
        assert list(line.get_xdata()) == [0, 1, 2]
        assert list(line.get_ydata()) == [r[key] for r in LOG]
    assert list(lines[f'{labels[1]}|test_acc1'].get_ydata()) == [11.0, 60.5]
    assert f'{labels[1]}|test_ema_acc1' not in lines                     # not logged, not drawn
    assert fig.axes[1].get_yscale() == 'log'
    out = pl.main([str(a), str(b), '-o', str(tmp_path / 'curves.png')])
    assert os.path.getsize(out) > 0
    assert os.path.getsize(pl.main([str(a)])) > 0 and (a / 'curves.png').exists()


@pytest.mark.parametrize('content, message', [
    (None, r'missing: no such directory or file'),
    ('', r'log\.txt: empty \(no epoch logged\)'),
    ('\n\n', r'log\.txt: empty'),
    ('{"epoch": 0, "train_loss": 1.0}\n{"epoch": 1, "train_loss": \n', r'log\.txt:2: not valid JSON'),
    ('[1, 2]\n', r'log\.txt:1: expected a JSON object, got list'),
    ('{"train_loss": 1.0}\n', r'log\.txt:1: no numeric "epoch"'),
    ('{"epoch": 0, "test_acc1": "high"}\n', r'log\.txt:1: "test_acc1" is not a number'),
])
def test_plot_log_errors_name_file_and_line(tmp_path, content, message):
    target = tmp_path / 'missing'
    if content is not None:
        target.mkdir()
        (target / 'log.txt').write_text(content)
    with pytest.raises(pl.LogError, match=message):
        pl.read_log(str(target))
    with pytest.raises(SystemExit) as exc:
        pl.main([str(target)])
    assert str(exc.value).startswith('plot_log: error: ') and '\n' not in str(exc.value)


def test_the_documented_commands_write_where_docs_say_without_overwriting(tmp_path, monkeypatch, capsys):
    """docs/analysis.md's two analyze_attention commands, run as written (fewer images, a small checkpoint
    standing in for make demo's) from one directory: each writes into the folder its comment names."""
    import re
    import shlex
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'docs', 'analysis.md')) as f:
        block = f.read().split('```bash\n', 1)[1].split('```', 1)[0].replace('\\\n', ' ')
    commands = [line for line in block.splitlines() if line.startswith('python tools/analyze_attention.py')]
    assert len(commands) == 2
    monkeypatch.chdir(tmp_path)
    os.makedirs('output/demo')
    torch.manual_seed(0)
    model = timm.create_model('NALAFORMER_XT', num_classes=10)
    torch.save({'model': model.state_dict(), 'args': {'input_size': 32, 'data_set': 'DIGITS'}},
               'output/demo/checkpoint.pth')
    written = []
    for line in commands:
        command, comment = line.split('#', 1)
        folder = re.search(r'-> (\S+)/', comment).group(1)
        aa.main(shlex.split(command)[2:] + ['--num-images', '2', '--input-size', '32'])
        files = capsys.readouterr().out.splitlines()[-1].removeprefix('wrote ').split(', ')
        assert files and all(os.path.dirname(f) == folder and os.path.getsize(f) > 0 for f in files), (folder, files)
        written.append(set(files))
    assert not written[0] & written[1]


def test_cli_bad_checkpoint_is_one_line(tmp_path):
    """A missing file, or one without a classifier head, ends the tool with one line naming the file."""
    _write_images(tmp_path / 'imgs')
    missing = tmp_path / 'nothing.pth'
    with pytest.raises(SystemExit, match=r'analyze_attention: error: checkpoint .*nothing\.pth does not exist'):
        aa.main(['--model', 'NALAFORMER_XT', '--checkpoint', str(missing), '--images', str(tmp_path / 'imgs')])
    headless = tmp_path / 'headless.pth'
    torch.save({'model': {'patch_embed.proj.weight': torch.zeros(1)}}, headless)
    with pytest.raises(SystemExit, match=r'headless\.pth: no head\.weight; not a NaLaFormer checkpoint'):
        aa.main(['--model', 'NALAFORMER_XT', '--checkpoint', str(headless), '--images', str(tmp_path / 'imgs')])


def test_cli_bad_image_folder_is_one_line(tmp_path):
    """A missing folder, or one without images, ends the tool with one line naming --images."""
    with pytest.raises(SystemExit, match=r'analyze_attention: error: --images .*nowhere: no such folder'):
        aa.main(['--model', 'NALAFORMER_XT', '--images', str(tmp_path / 'nowhere')])
    (tmp_path / 'empty' / 'sub').mkdir(parents=True)
    (tmp_path / 'empty' / 'sub' / 'notes.txt').write_text('no images here')
    with pytest.raises(SystemExit, match=r'--images .*empty: no image files \(.*\) in it or below it'):
        aa.main(['--model', 'NALAFORMER_XT', '--images', str(tmp_path / 'empty')])
