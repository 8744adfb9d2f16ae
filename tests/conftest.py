"""Shared fixtures and helpers: the one-thread fixture of small tests, the command-line parser, and the
real-process helpers (a tiny ImageFolder, main.py as a plain process or under torchrun, signals)."""
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from helpers.image_folders import make_imagefolder

import cli
import main
from run import checkpoint, output_dir, resume
from training import optim


@pytest.fixture(scope='module')
def one_thread():
    """One intra-op thread for a module of small tests: on a shared 2-core machine a second spinning
    OpenMP thread costs more than it brings."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def build_xt(num_classes=3):
    """NALAFORMER_XT as main.py builds it."""
    return main.build_model(cli.get_args_parser().parse_args(['--model', 'NALAFORMER_XT']), num_classes)


def optimizer_of(args, model):
    """main.py's optimizer of the command line `args` for `model`."""
    return optim.build_optimizer(model, cli.settings(optim.OptimizerSettings, args))


def scheduler_of(args, opt):
    """main.py's LR schedule of the command line `args` for the optimizer `opt`."""
    return optim.build_lr_scheduler(opt, cli.settings(optim.Schedule, args))


class TrainingRun:
    """main.py's checkpoints of a run (run.checkpoint.RunCheckpoints) and the resume into its parts, built from the
    command line `args`, for the tests of both: `save`, `record_accuracy`, `append_log`, ... are the checkpoints',
    `resume` resumes into them."""

    def __init__(self, args, model, model_ema, optimizer, lr_scheduler, loss_scaler, n_parameters, device,
                 classes=None, n_train_images=None):
        self.args = args
        parts = checkpoint.TrainingParts(model, model_ema, optimizer, lr_scheduler, loss_scaler)
        self.saver = checkpoint.RunCheckpoints(
            output_dir=args.output_dir, parts=parts, run_args=checkpoint.args_to_dict(args), n_parameters=n_parameters,
            device=device, save_freq=args.save_freq, classes=classes, n_train_images=n_train_images)

    def __getattr__(self, name):
        return getattr(self.saver, name)

    @property
    def model(self):
        return self.saver.parts.model

    @property
    def optimizer(self):
        return self.saver.parts.optimizer

    @property
    def classes(self):
        return self.saver.classes

    @classes.setter
    def classes(self, value):
        self.saver.classes = value

    def resume(self, path, eval_only=False):
        """main.py's resume: the checkpoint's recorded command line read first."""
        recorded = checkpoint.recorded_args(path) if path else {}
        return resume.resume(path, self.saver, cli.settings(resume.ResumeSettings, self.args), recorded,
                             eval_only=eval_only, changes=optim.flag_changes(recorded, self.saver.run_args))


def run_dir_of(args):
    """The output-directory settings of the command line `args`."""
    return cli.settings(output_dir.OutputDirSettings, args)


def parse(*argv):
    """main.py's arguments for `argv` (parsed, not validated)."""
    return cli.get_args_parser().parse_args(list(argv))


def untrained_eval_argv(data, tmp_path):
    """main.py --eval of an untrained 3-class XT on the tiny ImageFolder, without --num_workers."""
    import timm
    ck = tmp_path / 'ck.pth'
    torch.save({'model': timm.create_model('NALAFORMER_XT', num_classes=3).state_dict()}, ck)
    return ['--model', 'NALAFORMER_XT', '--input-size', '32', '--batch-size', '4', '--device', 'cpu', '--no-flops',
            '--eval', '--resume', str(ck), '--data-path', data]



# --------------------------------------------------------------------------------------- real processes
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
TORCHRUN = [PY, '-m', 'torch.distributed.run']
LAUNCH = [PY, '-W', 'ignore::FutureWarning', '-m', 'torch.distributed.launch', '--use_env']  # the reference's launcher

# small and fast: 32 px NALAFORMER_XT, 3 classes x 8 train images, 15 val images (odd: not divisible by 2 ranks)
BASE = ['--model', 'NALAFORMER_XT', '--input-size', '32', '--batch-size', '4', '--device', 'cpu',
        '--num_workers', '1', '--no-flops', '--print-freq', '1', '--unscale-lr', '--lr', '2e-3',
        '--warmup-epochs', '1', '--epochs', '2']


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def env():
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1', PYTHONWARNINGS='ignore::UserWarning')
    for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT', 'SLURM_PROCID', 'SLURM_NTASKS'):
        e.pop(k, None)
    return e


def run_main(args, nproc=1, timeout=240, check=True, launcher=TORCHRUN, **kw):
    """main.py as a plain process (nproc=1) or under `launcher` (torchrun, or the old
    `torch.distributed.launch --use_env`) with nproc CPU processes."""
    cmd = ([PY, 'main.py'] if nproc == 1 else
           launcher + [f'--nproc_per_node={nproc}', '--master_addr=127.0.0.1', f'--master_port={free_port()}',
                       'main.py'])
    if nproc > 1 and '--dist-timeout' not in args:
        # a test that hangs in a collective fails instead of waiting 30 min
        args = list(args) + ['--dist-timeout', '120']
    proc = subprocess.Popen(cmd + list(args), cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, **kw)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun's workers too, not only the launcher
        out, err = proc.communicate()
        raise AssertionError(f'timed out after {timeout}s\nSTDOUT:\n{out[-4000:]}\nSTDERR:\n{err[-4000:]}') from None
    p = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check and p.returncode != 0:
        raise AssertionError(f'exit {p.returncode}\nSTDOUT:\n{p.stdout[-4000:]}\nSTDERR:\n{p.stderr[-4000:]}')
    return p


def error_line(p, only: bool = True) -> str:
    """The `error:` line a failed main.py process ended with, on stderr and without a traceback; with
    `only`, it must be the one error line (several ranks may each print one otherwise: the last is taken)."""
    assert p.returncode not in (0, None)
    assert 'Traceback' not in p.stderr, p.stderr[-3000:]
    errs = [line for line in p.stderr.splitlines() if 'error:' in line]
    assert (len(errs) == 1) if only else errs, p.stderr[-3000:]
    return errs[-1]


def load(path):
    return torch.load(path, map_location='cpu', weights_only=True)


def assert_same_weights(a, b):
    for key in ('model', 'model_ema'):
        assert a[key].keys() == b[key].keys()
        diff = [k for k in a[key] if not torch.equal(a[key][k], b[key][k])]
        assert not diff, f'{key}: {len(diff)} tensors differ, e.g. {diff[:3]}'


def accuracy_line(out):
    lines = [line for line in out.splitlines() if line.startswith('Accuracy of the network')]
    assert lines, out[-3000:]
    return lines


@pytest.fixture(scope='module')
def data(tmp_path_factory):
    """A tiny ImageFolder (3 classes, 8 train and 5 val images each), one per test module."""
    return make_imagefolder(tmp_path_factory.mktemp('tiny'))


def start_process(cmd):
    """main.py (or torchrun) in its own session, its output piped, for signal_when."""
    return subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def signal_when(proc, pattern, sig, timeout=180):
    """Send `sig` once stdout shows `pattern`; return (stdout, stderr) after exit."""
    out = []
    t0 = time.time()
    try:
        for line in proc.stdout:
            out.append(line)
            if re.search(pattern, line):
                proc.send_signal(sig)
                t_sig = time.time()
                break
            assert time.time() - t0 < timeout
        else:
            raise AssertionError('no line matched ' + pattern + ':\n' + ''.join(out)[-3000:]
                                 + proc.stderr.read()[-3000:])
        rest, err = proc.communicate(timeout=120)
    finally:
        kill_group(proc)
    return ''.join(out) + rest, err, time.time() - t_sig


def run_to_end(cmd, timeout=240, code=0, environ=None):
    """`cmd` (a training script, plain or under torchrun) in its own session to its end, which must be exit status
    `code`; on a timeout its process group is killed and its output shown."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=environ or env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        raise AssertionError(f'timed out after {timeout}s\nSTDOUT:\n{out[-4000:]}\nSTDERR:\n{err[-4000:]}') from None
    assert proc.returncode == code, out[-3000:] + err[-3000:]
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def kill_group(proc):
    """Leave no process of a failed test behind (torchrun workers included)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
