"""The paper's training recipe reaches every entry point: per-variant drop path, skipped non-finite
steps that leave the model (and its BatchNorm statistics and EMA) untouched, strict-JSON logs, BCE
targets, TF32 precision defaults, --eval without train/, and gradient accumulation."""
import json
import math
import os
import subprocess

import pytest
import timm
import torch

import engine
import main
import models  # noqa: F401  (registers the variants)
import utils
from models.nalaformer import VARIANTS


def parse(*argv):
    return main.get_args_parser().parse_args(list(argv))


def last_block_drop_prob(model):
    return [m.drop_prob for m in model.modules() if hasattr(m, 'drop_prob')][-1]


# -------------------------------------------------------------------------------- drop path
@pytest.mark.parametrize('variant, rate', [('NALAFORMER_XT', 0.10), ('NALAFORMER_T', 0.10), ('NALAFORMER_S', 0.15),
                                           ('NALAFORMER_B', 0.40), ('NALAFORMER_L', 0.55)])
def test_create_model_builds_the_variants_own_drop_path(variant, rate):
    assert last_block_drop_prob(timm.create_model(variant)) == pytest.approx(rate)
    assert VARIANTS[variant]['drop_path'] == rate  # the table itself is not consumed by building
    assert last_block_drop_prob(timm.create_model(variant.lower(), drop_path_rate=0.3)) == pytest.approx(0.3)


def test_main_build_uses_the_variant_rate_unless_drop_path_is_given(capsys):
    assert main.drop_path_rate(main.build_model(parse('--model', 'NALAFORMER_S'), 10)) == pytest.approx(0.15)
    a = parse('--model', 'NALAFORMER_S', '--drop-path', '0.05')
    assert main.drop_path_rate(main.build_model(a, 10)) == pytest.approx(0.05)
    assert main.drop_path_rate(main.build_model(parse('--model', 'NALAFORMER_XT', '--drop-path', '0'), 10)) == 0.0
