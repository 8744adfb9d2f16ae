"""Modules the tests run or import that are not tests themselves: harnesses that wrap main.py for a
real-process run (``nan_micro_batch``: a NaN loss on one rank under gradient accumulation)."""
