"""What trains the weights: the data and the step that learns from it.

image_folder.py  fault-tolerant image folders and image decoding (undecodable images replaced or raised)
loaders.py       the samplers and loaders of a run, workers kept across epochs, batches normalised on the device
step.py          one optimizer step with its precision (autocast, TF32, accumulation, fp16 scaler, clipping)
optim.py         the optimizer, the learning-rate schedule, the EMA of the weights, and their flags
iterations.py    what the dense tasks' scripts share: run flags, the start of a run, stops and unreadable batches
"""
