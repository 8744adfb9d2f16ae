"""The benchmark programs at tiny sizes: tools/benchmark.py (one model, --compare, --sizes, its figures, flags
and the line that points an old command to its program), tools/block_sweep.py, paper_throughput.py,
gpu_benchmark.py, loader_speed.py and ema_speed.py, and every command of theirs that the docs show parses."""
import glob
import json
import os
import re
import shlex

import pytest
import torch
from conftest import REPO

from tools import benchmark, block_sweep, ema_speed, gpu_benchmark, loader_speed, paper_throughput, synthetic, timing
from training import step as training_step
from training.step import OptimizerStep

TINY = ['--model', 'NALAFORMER_XT', '--batch-size', '2', '--input-size', '32', '48', '--steps', '2',
        '--warmup', '1', '--gemm-size', '256', '--device', 'cpu']


pytestmark = pytest.mark.usefixtures('one_thread')  # tests/conftest.py


def test_train_and_inference_report_throughput_memory_and_efficiency(tmp_path, capsys):
    log = tmp_path / 'bench.jsonl'
    for mode, extra in (('train', []),
                        ('inference', ['--no-fast-path', '--dtype', 'bf16', '--channels-last'])):
        result = benchmark.main(TINY + ['--mode', mode, '--json', str(log)] + extra)
        assert result['mode'] == mode and result['input_size'] == [32, 48]
        assert result['img_s'] > 0 and result['achieved_gmac_s'] > 0 and result['gemm_gmac_s'] > 0
        assert 0 < result['efficiency'] < 10 and result['peak_step_mib'] > 0 and result['static_mib'] > 0
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r['mode'], r['fast_path'], r['dtype'], r['channels_last']) for r in lines] == [
        ('train', True, 'fp32', False), ('inference', False, 'bf16', True)]
    assert lines[0]['gmacs_per_image'] == 3 * lines[1]['gmacs_per_image']   # fwd + 2 x bwd
    out = capsys.readouterr().out
    assert 'img/s' in out and 'efficiency' in out and 'peak memory' in out


def test_sweep_writes_json_and_png(tmp_path):
    out = tmp_path / 'sweep'
    results = block_sweep.main(['--model', 'NALAFORMER_XT', '--sweep-sizes', '64', '96', '--steps', '1',
                                '--warmup', '0', '--out', str(out), '--device', 'cpu', '--sweep-min-seconds', '0'])
    assert (tmp_path / 'sweep.png').stat().st_size > 0
    saved = json.loads((tmp_path / 'sweep.json').read_text())
    assert saved['sizes'] == [64, 96] == results['sizes'] and saved['batch_size'] == 1
    for kind in ('nala', 'softmax', 'softmax_plain'):
        assert [r['tokens'] for r in saved[kind]] == [8 * 8, 12 * 12]   # stage 2: stride 8
        assert all(r['us_per_token'] > 0 and r['kib_per_token'] > 0 for r in saved[kind])


def test_compare_steps_our_model_and_a_timm_model_in_one_process(tmp_path, capsys):
    log = tmp_path / 'compare.jsonl'
    results = benchmark.main(['--model', 'NALAFORMER_XT', '--compare', 'convnext_atto', '--input-size', '32',
                              '--batch-size', '2', '--steps', '1', '--warmup', '0', '--gemm-size', '128',
                              '--device', 'cpu', '--json', str(log)])
    assert [(r['mode'], r['model']) for r in results] == [
        ('inference', 'NALAFORMER_XT'), ('inference', 'convnext_atto'),
        ('train', 'NALAFORMER_XT'), ('train', 'convnext_atto')]
    for r in results:
        assert r['img_s'] > 0 and r['efficiency'] > 0 and r['gmacs_per_image'] > 0
        assert r['cpu_malloc'] == 'system' and r['best_peer'] == 'convnext_atto' and r['compile'] is False
        assert r['efficiency_vs_best_peer'] == pytest.approx(
            r['efficiency'] / next(p['efficiency'] for p in results
                                   if p['model'] == 'convnext_atto' and p['mode'] == r['mode']))
    # one GEMM per mode: efficiencies compare as MACs x img/s
    inf_ours, inf_peer = results[0], results[1]
    assert inf_ours['efficiency_vs_best_peer'] == pytest.approx(
        inf_ours['gmacs_per_image'] * inf_ours['img_s'] / (inf_peer['gmacs_per_image'] * inf_peer['img_s']))
    assert all(r['cpu_s_median'] > 0 and r['efficiency_cpu_vs_best_peer'] > 0 for r in results)
    # the fvcore count of each model, not one model's count for both
    assert results[0]['gmacs_per_image'] != results[1]['gmacs_per_image']
    assert [json.loads(line)['model'] for line in log.read_text().splitlines()] == [r['model'] for r in results]
    out = capsys.readouterr().out
    assert 'convnext_atto' in out and 'eff/best' in out and 'CPU eff/best' in out


def test_compare_sweeps_sizes_and_builds_fixed_size_peers_for_each(tmp_path, capsys):
    """A model timm builds for one input size (vit here, swin alike) is built for every --sizes side; the
    sweep reports img/s and peak memory of every model per size."""
    results = benchmark.main(['--model', 'NALAFORMER_XT', '--compare', 'vit_tiny_patch16_224', '--sizes', '32',
                              '48', '--modes', 'inference', '--batch-size', '1', '--steps', '1', '--warmup', '0',
                              '--gemm-size', '128', '--device', 'cpu'])
    assert [(r['input_size'], r['model']) for r in results] == [
        ([32, 32], 'NALAFORMER_XT'), ([32, 32], 'vit_tiny_patch16_224'),
        ([48, 48], 'NALAFORMER_XT'), ([48, 48], 'vit_tiny_patch16_224')]
    assert all(r['img_s'] > 0 and r['peak_step_mib'] > 0 for r in results)
    vit = [r['gmacs_per_image'] for r in results if r['model'].startswith('vit')]
    assert vit[1] > vit[0]  # counted at each size: the 48 px ViT has 9 patches to the 32 px one's 4
    table = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip().startswith(('32 ', '48 '))]
    assert [(row[0], row[2]) for row in table] == [(str(r['input_size'][0]), r['model']) for r in results]


def test_sizes_needs_compare(capsys):
    with pytest.raises(SystemExit):
        benchmark.parse_args(['--sizes', '224', '512'])
    assert '--sizes needs --compare' in capsys.readouterr().err


def test_compare_rejects_an_unknown_model(capsys):
    with pytest.raises(SystemExit):
        benchmark.parse_args(['--compare', 'no_such_model'])
    assert "unknown timm model(s) ['no_such_model']" in capsys.readouterr().err


def test_paper_preset_tiny_prints_a_table_per_variant_and_size(tmp_path, capsys):
    log = tmp_path / 'paper.jsonl'
    results = paper_throughput.main(['--tiny', '--device', 'cpu', '--json', str(log)])
    assert [(r['model'], r['input_size'][0]) for r in results] == [
        ('NALAFORMER_XT', 32), ('NALAFORMER_XT', 48), ('NALAFORMER_T', 32), ('NALAFORMER_T', 48)]
    assert all(r['img_s'] > 0 and r['batch_size'] == 2 and r['dtype'] == 'fp32' for r in results)
    assert len(log.read_text().splitlines()) == 4
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith('| NALAFORMER')]
    assert len(table) == 2 and all(line.count('|') == 5 for line in table)


def test_paper_preset_defaults():
    cpu = paper_throughput.parse_args(['--device', 'cpu'])
    assert (cpu.batch_size, cpu.dtype, cpu.preset_models, cpu.cpu_malloc) == (64, 'fp32', None, 'system')
    gpu = paper_throughput.parse_args(['--device', 'cuda'])
    assert (gpu.batch_size, gpu.dtype) == (128, 'fp16')
    assert paper_throughput.parse_args(['--device', 'cuda', '--dtype', 'bf16']).dtype == 'bf16'


def test_data_loading_times_the_train_transform_per_worker(tmp_path):
    synthetic.make_jpegs(str(tmp_path / 'data'), count=8, size=(64, 48))
    assert len(list((tmp_path / 'data').rglob('*.jpg'))) == 8
    result = loader_speed.main(['--data-loading', str(tmp_path / 'data'), '--data-workers', '0', '--batch-size', '4',
                                '--input-size', '32', '--json', str(tmp_path / 'data.jsonl')])
    assert result['images'] == 8 and result['input_size'] == 32
    assert result['one_worker_img_s_wall'] > 0 and result['one_worker_img_s_cpu'] > 0
    cpu_ms = result['image_cpu_ms']
    assert 0 < cpu_ms['p10'] <= cpu_ms['p50'] <= cpu_ms['p90'] <= cpu_ms['p99']
    assert [(r['workers'], r['batch_size']) for r in result['loaders']] == [(0, 4)]
    assert result['loaders'][0]['first_batch_s'] > 0 and result['loaders'][0]['img_s'] > 0
    assert json.loads((tmp_path / 'data.jsonl').read_text())['images'] == 8
    assert result['cpu_transform_img_s_cpu'] > 0  # the whole transform on the CPU, as before the device took a part


def test_photo_jpegs_are_cut_from_real_photos_at_imagenet_sizes(tmp_path):
    from PIL import Image
    synthetic.make_photo_jpegs(str(tmp_path), count=12)
    sizes = [Image.open(p).size for p in sorted(tmp_path.rglob('*.jpg'))]
    assert len(sizes) == 12 and all(max(s) == 500 and 333 <= min(s) <= 400 for s in sizes)
    assert any(w < h for w, h in sizes) and any(w > h for w, h in sizes)  # portrait and landscape


@pytest.mark.parametrize('flags, enabled', [([], True), (['--no-tf32'], False)])
def test_fp32_figures_use_main_py_tf32_setting_and_say_so(flags, enabled, monkeypatch, capsys):
    """On CUDA, fp32 rows run with TF32 as main.py trains by default (--no-tf32: full fp32), and the row
    says which. training.step.set_tf32 stands in for CUDA here: it records the call and reports the flags set."""
    calls = []
    monkeypatch.setattr(training_step, 'set_tf32', lambda device, on=True: calls.append((str(device), on)) or True)
    result = benchmark.main(TINY + ['--mode', 'inference', '--steps', '1', '--warmup', '0'] + flags)
    assert calls == [('cpu', enabled)] and result['tf32'] is enabled
    assert f"tf32={'on' if enabled else 'off'}" in capsys.readouterr().out


def test_no_tf32_note_off_cuda(capsys):
    assert benchmark.main(TINY + ['--mode', 'inference', '--steps', '1', '--warmup', '0'])['tf32'] is None
    assert 'tf32=' not in capsys.readouterr().out


def test_published_top1_of_variants_and_listed_peers():
    from tools.benchmark import PUBLISHED_TOP1, published_top1
    assert published_top1('NALAFORMER_T') == 82.6 and published_top1('nalaformer_xt') == 79.1
    assert published_top1('convnext_tiny.fb_in1k') == 82.1 and published_top1('convnext_atto') is None
    assert all(benchmark.timm.is_model(name) and 'arXiv:' in source for name, (_, source) in PUBLISHED_TOP1.items())


def test_compare_reports_each_phase_as_it_goes_without_library_noise_and_aligns_long_names(capfd):
    """--compare prints a line per model and phase before its table, keeps the profiler's log lines out of the
    output (on a CUDA build of torch without a GPU: gpuGetDeviceCount errors, profiler start/stop lines, a
    CPUAllocator warning) and keeps the table aligned for a model name longer than the name column."""
    long_name = 'tf_mobilenetv3_small_minimal_100'
    benchmark.main(['--model', 'NALAFORMER_XT', '--compare', long_name, '--input-size', '32', '--batch-size', '2',
                    '--steps', '2', '--warmup', '0', '--gemm-size', '128', '--device', 'cpu'])
    out, err = capfd.readouterr()
    for noise in ('gpuGetDeviceCount', 'profiler_start', 'CPUAllocator', 'USDT'):
        assert noise not in out + err, (out + err)[-2000:]
    lines = out.splitlines()
    table_start = next(i for i, line in enumerate(lines) if line.startswith('mode '))
    progress = [line.split('] ', 1)[1] for line in lines[:table_start] if line.startswith('  [32x32, ')]
    for name in ('NALAFORMER_XT', long_name):
        assert any(p.startswith(name) and 'fvcore count' in p for p in progress), progress
        for mode in ('inference', 'train'):
            assert any(p.startswith(name) and f'{mode}: built' in p for p in progress), progress
            assert any(p.startswith(name) and f'{mode}: peak memory' in p for p in progress), progress
    for mode in ('inference', 'train'):
        assert [p for p in progress if p.startswith(f'{mode}: timed round')] == [
            f'{mode}: timed round {i} of 2 (one step of each model)' for i in (1, 2)]
    table = lines[table_start:table_start + 5]
    assert [row.split()[1] for row in table[1:]] == ['NALAFORMER_XT', long_name] * 2
    assert len({len(row) for row in table}) == 1, table  # every column where the header puts it


def test_ema_update_times_timms_update_and_mains(tmp_path):
    results = ema_speed.main(['--preset-models', 'NALAFORMER_XT', '--steps', '1', '--warmup', '0',
                              '--device', 'cpu', '--json', str(tmp_path / 'ema.jsonl')])
    assert [r['model'] for r in results] == ['NALAFORMER_XT'] and results[0]['tensors'] > 100
    assert results[0]['timm ModelEmaV3 ms'] > 0 and results[0]['ema.ModelEma ms'] > 0


def test_gpu_benchmark_runs_every_part_at_a_tiny_size_on_the_cpu(tmp_path, capsys):
    """tools/gpu_benchmark.py with the CPU standing in for the GPU: two models (ours on both paths, one peer), eager
    only, one step each; the engine's step against forward+backward; the loader against the step."""
    log = tmp_path / 'gpu.jsonl'
    rows = gpu_benchmark.main(['--device', 'cpu', '--dtype', 'fp32', '--input-size', '32', '-b', '2',
                               '--steps', '1', '--warmup', '0', '--preset-models', 'NALAFORMER_XT', '--compare',
                               'convnext_atto', '--preset-eager-only', '--loader-images', '4', '--data-workers', '0',
                               '--json', str(log)])
    models = [(r['model'], r['compile']) for r in rows if r['part'] == 'model']
    assert models == [('NALAFORMER_XT', False), ('NALAFORMER_XT (plain path)', False), ('convnext_atto', False)]
    assert all(r['train_img_s'] > 0 and r['inference_img_s'] > 0 and r['train_peak_mib'] > 0
               for r in rows if r['part'] == 'model')
    (engine_row,) = [r for r in rows if r['part'] == 'engine']
    assert engine_row['engine_img_s'] > 0 and engine_row['bare_img_s'] > 0 and engine_row['host_syncs_per_step'] is None
    (loader,) = [r for r in rows if r['part'] == 'loader']
    assert loader['img_s'] > 0 and loader['workers_needed']['NALAFORMER_XT'] >= 1
    assert len(log.read_text().splitlines()) == len(rows)
    out = capsys.readouterr().out
    assert '| NALAFORMER_XT (plain path) | eager |' in out and 'host syncs per step' in out


def test_gpu_benchmark_defaults():
    gpu = gpu_benchmark.parse_args(['--device', 'cuda'])
    assert (gpu.batch_size, gpu.dtype, gpu.budget, gpu.input_size) == (128, 'bf16', 330.0, [224])


def test_host_syncs_per_step_counts_the_sync_warnings_of_one_step(monkeypatch):
    """The CUDA sync debug mode warns at every synchronising call; with the CPU standing in (a warning at
    every read of a tensor's value while the mode is on), the engine's step counts one."""
    import warnings

    import engine
    mode = {'on': False}
    real_tolist, real_item = torch.Tensor.tolist, torch.Tensor.item

    def warn_then(real):
        def call(self, *a, **kw):
            if mode['on']:
                warnings.warn('called a synchronizing CUDA operation', stacklevel=2)
            return real(self, *a, **kw)
        return call
    monkeypatch.setattr(torch.Tensor, 'tolist', warn_then(real_tolist))
    monkeypatch.setattr(torch.Tensor, 'item', warn_then(real_item))
    monkeypatch.setattr(torch.cuda, 'set_sync_debug_mode', lambda m: mode.update(on=m == 'warn'))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 3))
    step = OptimizerStep(torch.optim.SGD(model.parameters(), lr=0.1), 'cpu')
    batch = (torch.randn(4, 3, 2, 2), torch.tensor([0, 1, 2, 0]))

    def epoch(n):
        engine.train_one_epoch(model, lambda s, o, t: torch.nn.functional.cross_entropy(o, t),
                               gpu_benchmark.BatchList([batch] * n, 4), step, 0,
                               engine.TrainSettings(print_freq=10 ** 9))
    assert gpu_benchmark.host_syncs_per_step(epoch, 3) == 1.0


# ---- several dtypes, CPU time, the load warning, the allocator, the peak figure, gradient checkpointing ----
@pytest.fixture
def no_fvcore(monkeypatch):
    """A fixed MAC count instead of fvcore's (seconds per model; the count is tested above)."""
    monkeypatch.setattr(benchmark, 'model_macs', lambda name, size: 10 ** 7)
    monkeypatch.setattr(benchmark, 'model_macs_any', lambda name, size, fast_path=True: 10 ** 7)


def test_one_model_in_two_dtypes_interleaved_prints_the_speed_up(no_fvcore, capsys):
    results = benchmark.main(TINY + ['--mode', 'inference', '--dtype', 'fp32,bf16'])
    assert [r['dtype'] for r in results] == ['fp32', 'bf16']
    fp32, bf16 = results
    assert len(fp32['step_s_all']) == len(bf16['step_s_all']) == 2 and 'speedup' not in fp32
    assert bf16['speedup_over'] == 'fp32'
    assert bf16['speedup'] == pytest.approx(fp32['step_s_median'] / bf16['step_s_median'])
    assert bf16['speedup_cpu'] == pytest.approx(fp32['cpu_s_median'] / bf16['cpu_s_median'])
    assert fp32['cpu_s_median'] > 0 and 0 < fp32['cpu_busy']
    assert bf16['gemm_gmac_s'] != fp32['gemm_gmac_s']  # each dtype against its own GEMM
    out = capsys.readouterr().out
    assert f"bf16 over fp32: {bf16['speedup']:.2f}x img/s by wall time, {bf16['speedup_cpu']:.2f}x by CPU time" in out
    assert out.count('cpu_malloc=system') == 2 and benchmark.PEAK_NOTE in out


def test_compare_in_two_dtypes_ratios_per_dtype_and_speed_ups(no_fvcore, capsys):
    results = benchmark.main(['--model', 'NALAFORMER_XT', '--compare', 'convnext_atto', '--input-size', '32',
                              '--batch-size', '2', '--steps', '1', '--warmup', '0', '--gemm-size', '128',
                              '--device', 'cpu', '--modes', 'inference', '--dtype', 'fp32,bf16'])
    assert [(r['dtype'], r['model']) for r in results] == [
        ('fp32', 'NALAFORMER_XT'), ('fp32', 'convnext_atto'), ('bf16', 'NALAFORMER_XT'), ('bf16', 'convnext_atto')]
    for r in results:  # ratios against the peer in the same dtype, by wall and by CPU time
        peer = next(p for p in results if p['model'] == 'convnext_atto' and p['dtype'] == r['dtype'])
        assert r['img_s_vs_best_peer'] == pytest.approx(r['img_s'] / peer['img_s'])
        assert r['img_s_cpu_vs_best_peer'] == pytest.approx(peer['cpu_s_median'] / r['cpu_s_median'])
        assert r['cpu_malloc'] == 'system' and r['grad_checkpointing'] is None
    for fp32, bf16 in zip(results[:2], results[2:]):
        assert 'speedup' not in fp32 and bf16['speedup'] == pytest.approx(fp32['step_s_median'] / bf16['step_s_median'])
    out = capsys.readouterr().out
    assert out.count('fp32, bf16, batch 2, 32x32') == 1 and 'CPU img/s/best' in out and benchmark.PEAK_NOTE in out
    speedups = [line.split() for line in out.splitlines() if '/ fp32' in line and line.startswith('inference')]
    assert [(row[1], row[2]) for row in speedups] == [('NALAFORMER_XT', 'bf16'), ('convnext_atto', 'bf16')]


def test_a_process_short_of_cpu_time_warns_and_names_the_cause_by_the_load_average(no_fvcore, monkeypatch, capsys):
    """The process CPU time of the timed steps against their wall time x threads: with the CPU clock
    stood still (as if other jobs had the cores), the run warns; rows that kept their threads busy do not."""
    monkeypatch.setattr(benchmark.time, 'process_time', lambda: 1.0)
    result = benchmark.main(TINY + ['--mode', 'inference', '--steps', '1', '--warmup', '0'])
    assert result['cpu_busy'] == 0.0
    assert 'warning: during the timed steps the process used 0% of its 1 threads' in capsys.readouterr().out
    busy = dict(result, cpu_busy=timing.CPU_BUSY_MIN)
    assert timing.load_warning([busy]) is None and timing.load_warning([dict(busy, cpu_busy=None)]) is None
    # the load average names the cause: above the process's threads another job, else the steps' own idle threads
    shared = timing.load_warning([result], load1=2.0)
    assert 'load average 2.00: another job was probably on the cores' in shared
    alone = timing.load_warning([result], load1=1.2)
    assert 'load average 1.20: no other job' in alone and 'another job' not in alone


def test_one_allocator_default_for_one_model_compare_and_the_other_programs():
    for argv in ([], ['--compare', 'convnext_atto']):
        assert benchmark.parse_args(argv).cpu_malloc == 'system'
    for program in (paper_throughput, gpu_benchmark, block_sweep):
        assert program.parse_args(['--device', 'cpu']).cpu_malloc == 'system'
    assert benchmark.parse_args(['--cpu-malloc', 'retain']).cpu_malloc == 'retain'


def test_help_says_what_the_peak_memory_figure_holds(capsys):
    with pytest.raises(SystemExit):
        benchmark.parse_args(['--help'])
    out = ' '.join(capsys.readouterr().out.split())
    assert ' '.join(benchmark.PEAK_NOTE.split()) in out and '--grad-checkpointing' in out


@pytest.mark.parametrize('program, argv, message', [
    (benchmark, ['--dtype', 'fp32,int8'], "--dtype: unknown dtype(s) ['int8']"),
    (block_sweep, ['--dtype', 'fp32,bf16'], 'tools/block_sweep.py takes one --dtype'),
    (paper_throughput, ['--dtype', 'bf16,fp32'], 'tools/paper_throughput.py takes one --dtype'),
    (gpu_benchmark, ['--dtype', 'fp16', '--device', 'cpu'], 'fp16 needs a GPU'),
    (paper_throughput, ['--grad-checkpointing'], 'unrecognized arguments: --grad-checkpointing'),
    (loader_speed, [], 'give --data-loading DIR'),
])
def test_dtype_list_and_grad_checkpointing_refuse_what_they_do_not_fit(program, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        program.parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize('argv, program, flags', [
    (['--preset', 'gpu', '--budget', '100', '--json', 'g.jsonl'], gpu_benchmark,
     ['--budget', '100', '--json', 'g.jsonl']),
    (['--preset=paper', '--tiny', '--device', 'cpu'], paper_throughput, ['--tiny', '--device', 'cpu']),
    (['--model', 'NALAFORMER_T', '--sweep', '--out', 'docs/results/sweep'], block_sweep,
     ['--model', 'NALAFORMER_T', '--out', 'docs/results/sweep']),
    (['--ema-update', '--device', 'cpu', '--threads', '1'], ema_speed, ['--device', 'cpu', '--threads', '1']),
    (['--make-photos', '/tmp/my photos', '--data-loading', '/tmp/my photos', '--data-workers', '0', '1'], loader_speed,
     ['--make-photos', '/tmp/my photos', '--data-loading', '/tmp/my photos', '--data-workers', '0', '1']),
])
def test_an_old_command_of_another_measurement_names_its_program_in_one_line(argv, program, flags, capsys):
    """A command of a measurement that is a program of its own (from notes and scripts) stops with one line:
    that program with the same flags (exit 2, nothing run); the line is a command that program accepts."""
    with pytest.raises(SystemExit) as exit_info:
        benchmark.main(argv)
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2 and out == '' and len(err.splitlines()) == 1, err
    path = f'tools/{program.__name__.rsplit(".", 1)[1]}.py'
    command = shlex.split(err.split(': python ', 1)[1])
    assert command == [path] + flags, err
    program.parse_args(command[1:])


def test_an_unknown_preset_names_both_preset_programs(capsys):
    with pytest.raises(SystemExit) as exit_info:
        benchmark.parse_args(['--preset', 'cpu'])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1
    assert 'tools/paper_throughput.py (paper)' in err and 'tools/gpu_benchmark.py (gpu)' in err


PROGRAMS = {m.__name__.rsplit('.', 1)[1]: m
            for m in (benchmark, block_sweep, ema_speed, gpu_benchmark, loader_speed, paper_throughput)}


def doc_commands() -> list[tuple[str, str, list[str]]]:
    """(page, program, flags) of every benchmark program command in a bash block of README.md and docs/ (not
    docs/results/, which keeps what ran on its date); optional flags in [brackets] count as given."""
    pages = glob.glob(os.path.join('docs', '**', '*.md'), root_dir=REPO, recursive=True)
    pages = ['README.md'] + sorted(p for p in pages if not p.startswith(os.path.join('docs', 'results', '')))
    found = []
    for page in pages:
        with open(os.path.join(REPO, page)) as f:
            blocks = re.findall(r'```bash\n(.*?)```', f.read(), re.S)
        for line in '\n'.join(blocks).replace('\\\n', ' ').splitlines():
            m = re.search(r'python tools/(\w+)\.py(.*)', line)
            if m and m.group(1) in PROGRAMS:
                flags = re.split(r' #|2>&1|\|', m.group(2))[0].replace('[', ' ').replace(']', ' ')
                found.append((page, m.group(1), shlex.split(flags)))
    return found


def test_every_benchmark_command_in_the_docs_parses(capsys):
    """The docs show every benchmark program, each command as its program accepts it."""
    commands = doc_commands()
    assert set(PROGRAMS) == {program for _, program, _ in commands}, commands
    for page, program, flags in commands:
        try:
            PROGRAMS[program].parse_args(flags)
        except SystemExit:
            pytest.fail(f'{page}: tools/{program}.py {shlex.join(flags)}: {capsys.readouterr().err}')


def test_grad_checkpointing_is_turned_on_where_supported_and_named_where_not(no_fvcore, capsys):
    """--grad-checkpointing reaches every stage of NaLaFormer; dla46_c, whose timm class refuses it, runs
    without and the table's header says so."""
    xt = timing.create_any('NALAFORMER_XT', torch.device('cpu'), True)
    assert benchmark.with_grad_checkpointing(xt) and all(stage.grad_checkpointing for stage in xt.layers)
    assert not benchmark.with_grad_checkpointing(timing.create_any('dla46_c', torch.device('cpu'), True))
    results = benchmark.main(['--model', 'NALAFORMER_XT', '--compare', 'dla46_c', '--input-size', '32',
                              '--batch-size', '2', '--steps', '1', '--warmup', '0', '--gemm-size', '128',
                              '--device', 'cpu', '--modes', 'train', '--grad-checkpointing'])
    assert [(r['model'], r['grad_checkpointing']) for r in results] == [('NALAFORMER_XT', True), ('dla46_c', False)]
    assert ('gradient checkpointing: on for NALAFORMER_XT (not supported by dla46_c: run without)'
            in capsys.readouterr().out)


def test_tasks_import_only_the_shared_timing_module_of_tools_and_it_imports_no_program():
    """segmentation/ (and any task) times its steps with tools/timing.py, never a tool program's internals;
    tools/timing.py imports neither a tool program nor a task, so the arrows point one way."""
    import ast

    def imported(path: str) -> set[str]:
        with open(os.path.join(REPO, path)) as f:
            tree = ast.parse(f.read())
        names = {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                names |= {node.module} | {f'{node.module}.{a.name}' for a in node.names}
        return names
    tasks = [p for task in ('segmentation', 'detection') for p in glob.glob(f'{task}/*.py', root_dir=REPO)]
    assert 'segmentation/upernet_benchmark.py' in tasks
    for path in tasks:
        from_tools = {n for n in imported(path) if n.split('.')[0] == 'tools'}
        assert from_tools <= {'tools.timing', 'tools.timing.peak_bytes', 'tools.timing.time_call'}, (path, from_tools)
    timing_imports = imported('tools/timing.py')
    assert not {n for n in timing_imports if n.split('.')[0] in ('tools', 'segmentation', 'detection')}, timing_imports
