# `make test` and `make demo` build the virtual environment from requirements.txt and requirements-dev.txt
# (tests, lint) on first use, with the newest tested releases (constraints.txt); `make test-min` builds
# .venv-min with the oldest supported ones (constraints-min.txt) and runs the fast suite in it, with the
# few real-process tests marked min_stack (SLURM's requeue signal, whose handling depends on torchrun).
# TORCH_INDEX: a pip index that torch and torchvision are installed from first, at the same pinned versions, e.g.
# PyTorch's CPU wheels on a machine without a GPU (PyPI's Linux wheels bring CUDA: about 6 GB in .venv):
#   make venv TORCH_INDEX=https://download.pytorch.org/whl/cpu
PYTHON ?= python3
TORCH_INDEX ?=
VENV ?= .venv
PY := $(VENV)/bin/python
VENV_MIN ?= .venv-min
PY_MIN := $(VENV_MIN)/bin/python

.PHONY: det-demo test test-fast test-min lint smoke venv venv-min venv-optional demo demo-min seg-demo clean-venv

venv: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements-dev.txt constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(if $(TORCH_INDEX),$(PY) -m pip install -q torch torchvision -c constraints.txt --index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -r requirements.txt -r requirements-dev.txt -c constraints.txt
	touch $@

# torch 2.4.0 / torchvision 0.19.0 / the oldest accepted timm (PyPI's CUDA wheels: 5.4 GB, a few minutes)
venv-min: $(VENV_MIN)/.installed

$(VENV_MIN)/.installed: requirements.txt requirements-dev.txt constraints-min.txt
	test -x $(PY_MIN) || $(PYTHON) -m venv $(VENV_MIN)
	$(if $(TORCH_INDEX),$(PY_MIN) -m pip install -q torch torchvision -c constraints-min.txt --index-url $(TORCH_INDEX))
	$(PY_MIN) -m pip install -q -r requirements.txt -r requirements-dev.txt -c constraints-min.txt
	touch $@

# the optional extras (ONNX export, TensorBoard); without them their tests skip with a reason
venv-optional: $(VENV)/.installed-optional

$(VENV)/.installed-optional: requirements-optional.txt $(VENV)/.installed
	$(PY) -m pip install -q -r requirements-optional.txt
	touch $@

test: venv
	$(PY) -m pytest -q tests

# the inner loop: everything but the real-process runs
test-fast: venv
	$(PY) -m pytest -q -m 'not slow' tests

# the fast suite on the oldest supported releases, and the few real-process tests marked min_stack
test-min: venv-min
	$(PY_MIN) -m pytest -q -m 'not slow or min_stack' tests

# style and simple bugs (rules in pyproject.toml); `ruff check --fix .` repairs the import order
lint: venv
	$(VENV)/bin/ruff check .

clean-venv:
	rm -rf $(VENV) $(VENV_MIN)

# `make demo`: NALAFORMER_XT on the scikit-learn digits (DIGITS, 64 px) on the CPU, trained afresh into
# output/demo: --overwrite deletes an earlier demo's checkpoints and log.txt there and says so; other files
# (a curves.png you drew) stay. Short-run settings: a few epochs at a higher LR, light augmentation, no mixup/EMA.
# OMP_WAIT_POLICY=PASSIVE stops PyTorch's CPU threads from busy-waiting, which makes a run many times
# slower when other processes share the cores.
DEMO_FLAGS = --model NALAFORMER_XT --data-set DIGITS --input-size 64 --device cpu --epochs 6 \
	--batch-size 32 --lr 1e-3 --unscale-lr --warmup-epochs 1 --mixup 0 --cutmix 0 --reprob 0 --aa none \
	--no-repeated-aug --no-model-ema --num_workers 1 --print-freq 20

demo: venv
	OMP_WAIT_POLICY=PASSIVE $(PY) main.py $(DEMO_FLAGS) --output_dir output/demo --overwrite

# the same demo on the oldest supported releases, into output/demo-min
demo-min: venv-min
	OMP_WAIT_POLICY=PASSIVE $(PY_MIN) main.py $(DEMO_FLAGS) --output_dir output/demo-min --overwrite

# `make seg-demo`: UperNet over NALAFORMER_XT on a synthetic scene set in the ADE20K layout that
# segmentation/scenes.py writes (5 texture classes), trained from scratch on the CPU through segmentation/train.py's
# real loader and loop, evaluated before and after training. Short-run settings: 64 px crops, 128 channels,
# a higher LR and a short warmup (docs/segmentation.md).
SEG_DEMO_FLAGS = --model NALAFORMER_XT --num-classes 5 --device cpu --iters 300 --batch-size 8 --crop-size 64 \
	--img-scale 128 64 --channels 128 --lr 1e-3 --warmup-iters 30 --eval-interval 150 --eval-at-start \
	--print-freq 50 --num_workers 1

seg-demo: venv
	OMP_WAIT_POLICY=PASSIVE $(PY) segmentation/scenes.py output/seg-demo-data
	OMP_WAIT_POLICY=PASSIVE $(PY) segmentation/train.py $(SEG_DEMO_FLAGS) --data-path output/seg-demo-data \
		--output_dir output/seg-demo --overwrite

# `make det-demo`: Mask R-CNN over NALAFORMER_XT on a synthetic COCO-layout set of shapes with masks that
# detection/shapes.py writes (3 classes), trained from scratch on the CPU through detection/train.py's real loader
# and loop with --recipe demo (docs/detection.md), evaluated after every epoch; then the best checkpoint's
# predictions drawn into output/det-demo/show.
det-demo: venv
	OMP_WAIT_POLICY=PASSIVE $(PY) detection/shapes.py output/det-demo-data
	OMP_WAIT_POLICY=PASSIVE $(PY) detection/train.py --recipe demo --model NALAFORMER_XT --device cpu --print-freq 7 \
		--num_workers 1 --data-path output/det-demo-data --output_dir output/det-demo --overwrite
	OMP_WAIT_POLICY=PASSIVE $(PY) detection/train.py --eval --resume output/det-demo/best.pth --device cpu \
		--num_workers 1 --data-path output/det-demo-data --show-dir output/det-demo/show

# `make smoke`: every training path (DDP, fp16/bf16, compile, channels-last, SyncBN, EMA, resume) once on this
# machine's GPU; on a CPU the quick set without compile (`python tools/smoke.py --all` runs every path there)
smoke: venv
	$(PY) tools/smoke.py
