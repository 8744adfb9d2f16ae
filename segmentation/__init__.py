"""Semantic segmentation on ADE20K with a NaLaFormer backbone: UperNet head, mmseg's ADE20K recipe, exact mIoU
under DDP. Run ``python segmentation/train.py`` from the repository root (docs/segmentation.md)."""
