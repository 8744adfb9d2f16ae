"""Modules the tests import or run that are not tests themselves.

image_folders.py   tiny image folders and data-set arguments that tests write for themselves
reference_impl.py  an independent transcription of the reference forward pass, and name-seeded weights
thread_world.py    several ranks as threads in one process, for what ranks must agree on
cluster.py         a cluster on one machine: fake SLURM commands on PATH, processes and signals as SLURM sends them
nan_micro_batch.py main.py with a NaN loss on one rank under gradient accumulation (a real-process harness)
"""
