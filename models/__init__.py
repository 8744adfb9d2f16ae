"""NaLaFormer models; importing this package registers the variants in timm."""
from .nala import NaLaAttention, RoPE, SoftmaxAttention, nala_attention_plain
from .nalaformer import PAPER_FIGURES, VARIANTS, NaLaFormer, checkpoint_filter_fn
