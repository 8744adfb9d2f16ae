"""tools/profile_ops.py at a tiny input: every op lands in one (stage, family) cell, the cells add up
to the profiled step, the model is left as it was, and the JSON lines."""
import json

import pytest
import torch

import models.nala as nala
from tools import profile_ops
from tools.timing import create_any, make_step

pytestmark = pytest.mark.usefixtures('one_thread')  # tests/conftest.py


def test_cells_sum_to_the_step_and_cover_every_part(tmp_path, capsys):
    log = tmp_path / 'profile.jsonl'
    results = profile_ops.main(['--model', 'NALAFORMER_XT', '--sizes', '32', '--batch-sizes', '2',
                                '--warmup', '0', '--json', str(log)])
    assert [r['mode'] for r in results] == ['inference', 'train']
    for r in results:
        cells = sum(v for row in r['cells'].values() for v in row.values())
        assert cells == pytest.approx(r['total_ms'], rel=1e-9)
        assert sum(r['stages'].values()) == pytest.approx(r['total_ms'], rel=1e-9)
        assert sum(r['families'].values()) == pytest.approx(r['total_ms'], rel=1e-9)
        # the profiled time is the step's time (the profiler's own overhead included)
        assert 0.5 * r['profiled_step_ms'] < r['total_ms'] <= 1.05 * r['profiled_step_ms']
        for stage in ('stem', 'stage1', 'stage2', 'stage3', 'stage4'):
            assert r['stages'][stage] > 0, stage
        for family in ('nala_core', 'softmax_attn', 'dwconv', 'conv', 'linear', 'ffn', 'norm'):
            assert r['families'][family] > 0, family
        assert r['cells']['stage1']['nala_core'] > 0 and r['cells']['stage1']['softmax_attn'] == 0
        assert r['cells']['stage3']['softmax_attn'] > 0 and r['cells']['stage3']['nala_core'] == 0
    train = results[1]
    assert train['families']['optimizer'] == pytest.approx(train['stages']['optimizer'])
    assert train['families']['optimizer'] > 0
    # backward ops follow their forward op: the NaLa core's backward is in stage 1-2's nala_core
    inference = results[0]
    assert train['cells']['stage1']['nala_core'] > inference['cells']['stage1']['nala_core']
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r['model'], r['size'], r['batch_size']) for r in lines] == [('NALAFORMER_XT', 32, 2)] * 2
    out = capsys.readouterr().out
    assert 'nala_core' in out and 'share' in out


def test_labels_are_removed_after_profiling():
    model = create_any('NALAFORMER_XT', torch.device('cpu'), True, (32, 32))
    x = torch.randn(1, 3, 32, 32)
    step, _ = make_step(model, x, torch.zeros(1, dtype=torch.long), 'inference', torch.float32,
                        torch.device('cpu'))
    originals = [getattr(owner, attr) for owner, attr, _ in profile_ops.FAST_PATH_FUNCTIONS]
    with profile_ops.labelled(model):
        assert nala.lepe_fast is not originals[0]
        assert any('core' in vars(m) for m in model.modules())
        step()
    assert [getattr(owner, attr) for owner, attr, _ in profile_ops.FAST_PATH_FUNCTIONS] == originals
    assert not any('core' in vars(m) for m in model.modules())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_bad_batch_sizes_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        profile_ops.main(['--sizes', '32', '48', '64', '--batch-sizes', '1', '2'])
    assert '--batch-sizes takes one value or one per size (3), got 2' in capsys.readouterr().err
