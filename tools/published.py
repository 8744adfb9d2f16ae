"""Published ImageNet-1k top-1 (%, 224 px, trained on ImageNet-1k only) of the timm models that
``tools/benchmark.py --compare`` is run against, each with the paper it comes from. The NaLaFormer
variants' figures are the paper's, in ``models.PAPER_FIGURES``."""

from models import PAPER_FIGURES

#: timm model name -> (top-1 %, source)
PUBLISHED_TOP1: dict[str, tuple[float, str]] = {
    'convnext_tiny': (82.1, 'ConvNeXt-T: Liu et al., A ConvNet for the 2020s, CVPR 2022, arXiv:2201.03545'),
    'pvt_v2_b2': (82.0, 'PVTv2-B2: Wang et al., PVT v2: Improved Baselines with Pyramid Vision Transformer, '
                        'CVMJ 2022, arXiv:2106.13797'),
    'pvt_v2_b1': (78.7, 'PVTv2-B1: Wang et al., PVT v2, CVMJ 2022, arXiv:2106.13797'),
    'swin_tiny_patch4_window7_224': (81.2, 'Swin-T: Liu et al., Swin Transformer: Hierarchical Vision '
                                           'Transformer using Shifted Windows, ICCV 2021, arXiv:2103.14030'),
    'efficientformerv2_s1': (79.0, 'EfficientFormerV2-S1 (trained with distillation): Li et al., Rethinking '
                                   'Vision Transformers for MobileNet Size and Speed, ICCV 2023, arXiv:2212.08059'),
}


def published_top1(name: str) -> float | None:
    """The published ImageNet-1k top-1 of a NaLaFormer variant or a listed timm model (a pretrained tag
    such as ``.fb_in1k`` is ignored), or None where none is listed."""
    if name.upper() in PAPER_FIGURES:
        return PAPER_FIGURES[name.upper()][2]
    entry = PUBLISHED_TOP1.get(name.split('.', 1)[0])
    return entry[0] if entry else None
