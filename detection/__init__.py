"""COCO object detection and instance segmentation: Mask R-CNN (or Faster R-CNN) over a timm backbone."""
