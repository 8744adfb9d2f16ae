"""Data the tests write for themselves."""
from tools.synthetic import write_imagefolder


def make_imagefolder(root, classes=3, n_train=8, n_val=5, size=32, seed=0):
    """Colour-coded classes (class c brightens channel c % 3), PNG files in train/ and val/; 5 val images per
    class by default, an odd total that two processes cannot split evenly."""
    return write_imagefolder(str(root), classes, n_train, n_val, size, seed)
