"""utils.retain_freed_cpu_memory: freed CPU tensor memory is reused instead of faulted in again."""
import os
import subprocess
import sys

import pytest
from conftest import REPO

# Allocates, touches and frees a 64 MiB tensor 20 times; prints the page faults of the last 4 rounds
# (with retain, glibc's heap takes up to ~10 rounds of alignment leftovers before it reuses blocks).
SCRIPT = r'''
import resource, sys
import torch
import utils
retained = utils.retain_freed_cpu_memory() if sys.argv[1] == 'retain' else None
faults = []
for _ in range(20):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty(16 * 2 ** 20)
    t.fill_(1.0)
    del t
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(retained, sum(faults[-4:]))
'''


def faults_of_last_rounds(mode: str):
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS='1')
    out = subprocess.run([sys.executable, '-c', SCRIPT, mode], env=env, cwd=REPO, capture_output=True,
                         text=True, check=True).stdout.split()
    return out[0], int(out[1])


@pytest.mark.slow
def test_retained_memory_is_reused_without_page_faults():
    retained, faults_retain = faults_of_last_rounds('retain')
    if retained != 'True':
        pytest.skip('no glibc mallopt here')
    _, faults_system = faults_of_last_rounds('system')
    pages = 4 * 64 * 2 ** 20 // os.sysconf('SC_PAGE_SIZE')
    assert faults_system > 0.9 * pages, (faults_system, pages)  # glibc maps and faults the 64 MiB each round
    assert faults_retain < 0.01 * pages, (faults_retain, pages)  # kept in the heap: reused without faults
