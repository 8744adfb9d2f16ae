"""A cluster on one machine, for the real-process tests of tests/integration/test_cluster.py and test_slurm.py.

* `FakeSlurm`: `sbatch`, `srun`, `scancel` and `scontrol` as small shell scripts on PATH. sbatch runs a batch
  script at once (as `sbatch --wait`) with the SLURM_* variables of its #SBATCH lines and options; srun starts one
  task per node on this machine, on --cpus-per-task CPUs (one without it, as Slurm >= 22.05 gives a step), and
  with --kill-on-bad-exit=1 kills the step when a task fails; `scancel --signal=SIG` signals every process of the
  running step, whatever its session or parent (slurmstepd signals the step's cgroup; here: every process that
  inherited the step's FAKE_SLURM_STEP variable), but not the batch shell or srun;
  `scontrol requeue` is recorded, for the test to run the job again. `warn()` sends the script's
  `--signal=B:SIG@T` to the batch shell, at the moment the test makes the time limit come.
* `start_node`: one "node" of a multi-node run: its own torchrun (or pretrain.sh), output to files.
"""
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Sequence

from conftest import PY, REPO, env

SHIMS = {
    'sbatch': r"""
# sbatch [--opt=value ...] SCRIPT [ARGS]: the batch script, at once and in the foreground
opts=()
while [[ $# -gt 0 && $1 == --* ]]; do opts+=("$1"); shift; done
script=$1; shift
opt() {  # the value of --$1=... in the script's #SBATCH lines, then in the options (the last one wins)
    local v=$2 o
    for o in $(sed -n 's/^#SBATCH //p' "$script") "${opts[@]}"; do [[ $o == --$1=* ]] && v=${o#*=}; done
    echo "$v"
}
job=${FAKE_SLURM_JOB_ID:-$(( $(cat "$FAKE_SLURM/last_job" 2>/dev/null || echo 41) + 1 ))}
echo "$job" > "$FAKE_SLURM/last_job"
nodes=$(opt nodes 1)
nodelist=$(printf 'localhost,%.0s' $(seq "$nodes"))
export SLURM_JOB_ID=$job SLURM_JOB_NAME=$(opt job-name sbatch) SLURM_JOB_NUM_NODES=$nodes SLURM_NNODES=$nodes
export SLURM_JOB_NODELIST=${nodelist%,} SLURM_CPUS_PER_TASK=$(opt cpus-per-task 1) SLURM_SUBMIT_DIR=$PWD
export SLURM_RESTART_COUNT=${SLURM_RESTART_COUNT:-0}
echo "sbatch $job $script $*" >> "$FAKE_SLURM/calls.log"
exec bash "$script" "$@"
""",
    'srun': r"""
# srun [--opt=value ...] COMMAND [ARGS]: the job step, one task per node
echo "srun $*" >> "$FAKE_SLURM/calls.log"
nodes=${SLURM_JOB_NUM_NODES:-1} cpus=${SRUN_CPUS_PER_TASK:-1} kill_on_bad=0
while [[ $1 == -* ]]; do
    case $1 in
        --nodes=*) nodes=${1#*=} ;;
        --cpus-per-task=*) cpus=${1#*=} ;;
        --kill-on-bad-exit=1) kill_on_bad=1 ;;
    esac
    shift
done
step="$FAKE_SLURM/step.$$"  # every process of the step inherits it: the step's cgroup, as far as signals go
echo "$step" > "$FAKE_SLURM/step"
max=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc obeys OMP_NUM_THREADS
(( cpus > max )) && cpus=$max
tasks=()
for ((i = 0; i < nodes; i++)); do
    FAKE_SLURM_STEP=$step SLURM_NODEID=$i SLURM_PROCID=$i SLURM_LOCALID=0 SLURM_NTASKS=$nodes \
        SLURM_STEP_NUM_NODES=$nodes SLURM_CPUS_PER_TASK=$cpus taskset -c "0-$((cpus - 1))" "$@" &
    tasks+=($!)
done
rc=0
for ((left = nodes; left > 0; left--)); do
    wait -n "${tasks[@]}"
    status=$?
    echo "srun: task exit $status" >> "$FAKE_SLURM/calls.log"
    if (( status != 0 )); then
        rc=$status
        if (( kill_on_bad )); then kill -KILL $(step_pids "$step") 2>/dev/null; fi  # slurmstepd ends the step
    fi
done
exit $rc
""",
    'scancel': r"""
# scancel [--signal=SIG] JOB: SIG (TERM) to every process of the running step
echo "scancel $*" >> "$FAKE_SLURM/calls.log"
sig=TERM
for a; do [[ $a == --signal=* ]] && sig=${a#--signal=}; done
pids=$(step_pids "$(cat "$FAKE_SLURM/step")")
[ -n "$pids" ] && kill -s "$sig" $pids 2>/dev/null
exit 0
""",
    'scontrol': r"""
# scontrol show hostnames LIST | scontrol requeue JOB (recorded)
echo "scontrol $*" >> "$FAKE_SLURM/calls.log"
[ "$1 $2" = "show hostnames" ] && tr ',' '\n' <<< "$3"
exit 0
""",
    'step_pids': r"""
# the processes of step $1: those whose environment holds FAKE_SLURM_STEP=$1 (orphans included)
grep -lzxF "FAKE_SLURM_STEP=$1" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3
""",
}


class FakeSlurm:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.bin = self.root / 'bin'
        self.bin.mkdir(parents=True)
        for name, body in SHIMS.items():
            (self.bin / name).write_text('#!/usr/bin/env bash\n' + body.lstrip('\n'))
            (self.bin / name).chmod(0o755)
        (self.root / 'calls.log').touch()

    def env(self, **extra: str) -> dict[str, str]:
        e = env()
        for k in [k for k in e if k.startswith(('SLURM_', 'SRUN_', 'PET_', 'TORCHELASTIC_'))]:
            del e[k]
        e.update(PATH=f'{self.bin}:{e["PATH"]}', FAKE_SLURM=str(self.root))
        e.update(extra)
        return e

    def sbatch(self, script: str, *args: str, options: Sequence[str] = (), log: Path | None = None,
               job: int | None = None, restarts: int = 0, **environ: str) -> subprocess.Popen:
        """Submit `script` (the batch shell is the returned process); its output goes to `log` (else a pipe)."""
        e = self.env(**environ)
        if job is not None:  # the same job again, as SLURM starts a requeued one
            e.update(FAKE_SLURM_JOB_ID=str(job), SLURM_RESTART_COUNT=str(restarts))
        out = open(log, 'a') if log else subprocess.PIPE
        try:
            return subprocess.Popen(['sbatch', *options, script, *args], cwd=REPO, env=e, stdout=out,
                                    stderr=subprocess.STDOUT if log else subprocess.PIPE, text=True,
                                    start_new_session=True)
        finally:
            if log:
                out.close()

    def warn(self, proc: subprocess.Popen, script: str) -> None:
        """The script's `#SBATCH --signal=B:SIG@T`, sent as SLURM sends it T s before the time limit: to the batch
        shell only (B:)."""
        with open(script) as f:
            m = re.search(r'^#SBATCH --signal=B:(\w+)@\d+', f.read(), re.M)
        assert m, 'the batch script asks for no warning signal to its shell'
        proc.send_signal(getattr(signal, 'SIG' + m.group(1)))

    def calls(self) -> list[str]:
        return (self.root / 'calls.log').read_text().splitlines()


# --------------------------------------------------------------------------------------- several "nodes"
def start_node(cmd: Sequence[str], log: Path, cwd: str = REPO, **environ: str) -> subprocess.Popen:
    """One node's launcher (torchrun, pretrain.sh) in its own session, stdout and stderr to `log`."""
    e = env()
    e.update(environ)
    with open(log, 'w') as out:
        return subprocess.Popen(list(cmd), cwd=cwd, env=e, stdout=out, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)


def torchrun_node(port: int, nnodes: int, nproc: int, args: Sequence[str], log: Path, cwd: str) -> subprocess.Popen:
    """torchrun with pretrain.sh's flags for several nodes (c10d rendezvous at 127.0.0.1:port) running main.py
    from directory `cwd` (node-local relative paths)."""
    cmd = [PY, '-m', 'torch.distributed.run', f'--nnodes={nnodes}', f'--nproc_per_node={nproc}',
           '--rdzv-backend=c10d', f'--rdzv-endpoint=127.0.0.1:{port}', '--rdzv-id=cluster-test',
           os.path.join(REPO, 'main.py'), *args]
    return start_node(cmd, log, cwd=cwd, TORCH_DISABLE_SHARE_RDZV_TCP_STORE='1')


def wait_for(pattern: str, logs: Sequence[Path], timeout: float = 240, procs: Sequence[subprocess.Popen] = ()
             ) -> str:
    """The first line of any of `logs` matching `pattern`; fails when a process in `procs` ends first."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        for log in logs:
            m = re.search(pattern, Path(log).read_text(errors='replace'), re.M)
            if m:
                return m.group(0)
        ended = [p for p in procs if p.poll() is not None]
        assert not ended, f'ended before {pattern!r}:\n' + '\n'.join(Path(x).read_text()[-3000:] for x in logs)
        time.sleep(0.1)
    raise AssertionError(f'no line matched {pattern!r}:\n' + '\n'.join(Path(x).read_text()[-3000:] for x in logs))


def finish(procs: Sequence[subprocess.Popen], timeout: float = 300) -> list[int]:
    """Wait for every process (killing all of their sessions after `timeout` s); their exit statuses."""
    t0 = time.time()
    try:
        for p in procs:
            p.wait(timeout=max(1.0, timeout - (time.time() - t0)))
    except subprocess.TimeoutExpired:
        raise AssertionError(f'still running after {timeout} s') from None
    finally:
        for p in procs:
            kill_session(p)
    return [p.returncode for p in procs]


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL to the process's session and all of its descendants (torchrun's workers start their own)."""
    pids = descendants(proc.pid)
    for sig_target in [proc.pid] + pids:
        try:
            os.kill(sig_target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def children(pid: int, **environ: object) -> list[int]:
    """PIDs of the direct children of `pid` (whose environment holds every NAME=value of `environ`)."""
    out = []
    for name in os.listdir('/proc'):
        if not name.isdigit():
            continue
        try:
            with open(f'/proc/{name}/stat') as f:
                ppid = int(f.read().rsplit(')', 1)[1].split()[1])
            with open(f'/proc/{name}/environ', 'rb') as f:
                e = f.read().split(b'\0')
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and all(f'{k}={v}'.encode() in e for k, v in environ.items()):
            out.append(int(name))
    return out


def descendants(pid: int) -> list[int]:
    """The PIDs of every process below `pid`."""
    children: dict[int, list[int]] = {}
    for name in os.listdir('/proc'):
        if name.isdigit():
            try:
                with open(f'/proc/{name}/stat') as f:
                    ppid = int(f.read().rsplit(')', 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def rank_errors(text: str) -> dict[int, list[str]]:
    """The `[rank N] error: ...` lines of a run's output, by rank."""
    out: dict[int, list[str]] = {}
    for rank, line in re.findall(r'^\[rank (\d+)\] error: (.*)$', text, re.M):
        out.setdefault(int(rank), []).append(line)
    return out
