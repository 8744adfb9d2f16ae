"""The CPUs and the memory a training process may count on (and so its default number of data-loader workers) and
its CPU memory allocator."""
import os
import re

import distributed

#: data-loader workers per process when --num_workers is not given: enough for a GPU's input pipeline
#: (docs/performance.md), capped by this process's share of the node's CPUs
DEFAULT_NUM_WORKERS = 10


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask: what taskset, cgroups cpusets and SLURM allow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call on this OS (macOS)
        return os.cpu_count() or 1


def _leading_int(text: str) -> int:
    m = re.match(r'\d+', text or '')
    return int(m.group()) if m else 0


def cpus_per_process() -> tuple[int, str]:
    """(CPUs this process may count on, how that share was found). The training processes of a node share its
    CPUs: torchrun starts LOCAL_WORLD_SIZE processes that all inherit its CPU set; SLURM gives each srun task
    SLURM_CPUS_PER_TASK CPUs (binding them or not), else the tasks on the node share the step's CPUs."""
    cpus = available_cpus()
    _, _, _, launcher = distributed.launch_env()
    env = os.environ
    if launcher == 'torchrun':
        n = max(1, _leading_int(env.get('LOCAL_WORLD_SIZE', '')) or 1)
        if n > 1:
            return cpus // n, f'the {cpus} CPUs of this process shared by the {n} processes on this node'
    elif launcher == 'slurm':
        per_task = _leading_int(env.get('SLURM_CPUS_PER_TASK', ''))
        if per_task:
            return min(cpus, per_task), f'SLURM_CPUS_PER_TASK={per_task}, {cpus} CPUs available to this process'
        n = max(1, _leading_int(env.get('SLURM_NTASKS_PER_NODE') or env.get('SLURM_STEP_TASKS_PER_NODE')
                                or env.get('SLURM_TASKS_PER_NODE', '')))
        if n > 1:
            return cpus // n, f'the {cpus} CPUs of this process shared by the {n} SLURM tasks on this node'
    return cpus, f'the {cpus} CPUs available to this process'


def default_num_workers() -> tuple[int, str]:
    """(--num_workers when not given, why): this process's share of the node's CPUs less one for the training
    process itself, at most DEFAULT_NUM_WORKERS and at least 1 (loading then overlaps the step even with a
    single CPU per process; --num_workers 0 loads in the training process). More workers than CPUs only
    compete for them (and PyTorch warns about it)."""
    share, how = cpus_per_process()
    n = max(1, min(DEFAULT_NUM_WORKERS, share - 1))
    return n, (f'{share} CPU(s) per process ({how}), one of them left to the training process; at most '
               f'{DEFAULT_NUM_WORKERS}, at least 1')


def _meminfo_bytes(*fields: str) -> int | None:
    """The sum of /proc/meminfo's `fields` (kB) in bytes; None where the file or a field is missing (not Linux)."""
    try:
        with open('/proc/meminfo') as f:
            values = dict(line.split(':', 1) for line in f if ':' in line)
        return sum(_leading_int(values[k].strip()) for k in fields) * 1024
    except (OSError, KeyError, ValueError):
        return None


def _cgroup_limit() -> int | None:
    """This process's cgroup memory limit in bytes (a container's, a SLURM job's), v2 or v1; None where none is
    set or none can be read."""
    paths = {}
    try:
        with open('/proc/self/cgroup') as f:
            for line in f:  # 'ID:CONTROLLERS:PATH'; v2 has the single line '0::PATH'
                _, controllers, path = line.rstrip('\n').split(':', 2)
                paths[controllers] = path.lstrip('/')
    except (OSError, ValueError):
        pass
    candidates = [os.path.join('/sys/fs/cgroup', paths.get('', ''), 'memory.max'), '/sys/fs/cgroup/memory.max']
    v1 = next((p for c, p in paths.items() if 'memory' in c.split(',')), '')
    candidates += [os.path.join('/sys/fs/cgroup/memory', v1, 'memory.limit_in_bytes'),
                   '/sys/fs/cgroup/memory/memory.limit_in_bytes']
    for path in candidates:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        return int(text) if text.isdigit() and int(text) < 2 ** 60 else None  # 'max' or v1's huge value: none
    return None


def available_memory() -> tuple[int | None, str]:
    """(bytes of memory a new allocation of this process may still get, what they are): the kernel's estimate of
    available RAM plus free swap, within the cgroup's memory limit when one is set; (None, '') where neither can
    be read. Generous on purpose: what a size check refuses against it cannot fit."""
    free = _meminfo_bytes('MemAvailable', 'SwapFree')
    if free is None:
        try:
            free = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
            what = 'physical memory'
        except (AttributeError, ValueError, OSError):
            return None, ''
    else:
        what = 'available RAM and free swap'
    limit = _cgroup_limit()
    if limit is not None and limit < free:
        return limit, "the cgroup's memory limit"
    return free, what


# --------------------------------------------------------------------------------------------------
# CPU memory allocator
# --------------------------------------------------------------------------------------------------
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameter numbers (malloc.h)


def retain_freed_cpu_memory() -> bool:
    """Keep freed CPU memory in the process for reuse instead of handing it back to the OS.

    glibc serves blocks above its mmap threshold (adaptive, at most 32 MiB) with a fresh ``mmap`` and
    unmaps them on free, so every large activation of every step page-faults and is zeroed again by
    the kernel. With mmap and heap trimming off, freed blocks are reused as they are. The cost: the
    process keeps its peak heap, and glibc's aligned allocations leave gaps that grow it for the first
    steps (figures in docs/performance.md). Returns False, changing nothing, where glibc's ``mallopt``
    is not available.
    """
    import ctypes
    import ctypes.util
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6').mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2 ** 31 - 1))
