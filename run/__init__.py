"""A run's life, shared by every task (main.py's classification, segmentation/, detection/).

errors.py       the one-line errors a run ends with, and the command line's two-line flag errors
distributed.py  the launcher, the process group, the collectives and the calls every rank agrees on
process.py      one process: stop signals, how it ends (exit status and one line), its CPUs and memory
output_dir.py   --output_dir: which checkpoint a run resumes, its lock, args.json, its repair after a resume
checkpoint.py   the checkpoint files and log.txt: names, atomic writes, checked reads, what a checkpoint holds
resume.py       resuming from a checkpoint (one path for every task) and the random-number state
weights.py      one set of weights from a checkpoint or release into a model, with one-line diagnoses
"""
