# calque. `make demo` runs the whole loop on this machine; `make test` is what CI runs; `make bench` measures.
# Every target installs what it needs first (setup), so each works from a clean clone.
# the interpreter that creates the venv (3.11 here)
PYTHON ?= python3
# where the pinned packages go
VENV ?= .venv
# extra pytest flags, e.g. PYTEST_ARGS="-k slug -x"
PYTEST_ARGS ?=
# Celery's venv for `make bench-peers` (bench/peers/requirements.txt), layered on $(VENV)
PEERS_VENV ?= .venv-peers
# Ray Data's venv for `make bench-peers` (bench/peers/requirements-ray.txt), layered on $(VENV) the same way
RAY_VENV ?= .venv-ray
# pytest-xdist processes `make test` runs the suite in: its tests mostly wait on real workers, polls and timeouts,
# so two overlap well on two cores; 0 runs it in this process, in file order
TEST_WORKERS ?= 2
PY := $(VENV)/bin/python
PEERS_PY := $(PEERS_VENV)/bin/python
RAY_PY := $(RAY_VENV)/bin/python
EMBED := $(VENV)/.embed-installed
MEDIA := $(VENV)/.media-installed
FASTBATCH_SO := fastbatch/.built

.PHONY: setup demo test bench bench-peers gpu-check clean

setup: $(VENV)/.installed $(FASTBATCH_SO)

# the venv is rebuilt when a requirements file changes; torch==2.13.0 comes from the CPU wheel on disk here
$(VENV)/.installed: requirements.txt requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

# calque itself, installed as `pip install .` installs it but editable (the checkout's files): the `calque` and
# `warmd` commands in $(VENV)/bin, and fastbatch's C module compiled in place by setup.py's cffi_modules; again when
# its build or sources change. A failed compile is not fatal: the numpy reference path takes over, and fastbatch
# says so in one line at its first batch
$(FASTBATCH_SO): $(VENV)/.installed pyproject.toml setup.py fastbatch/fastbatch.c fastbatch/fastbatch.h fastbatch/_build.py \
		fastbatch/plain.c
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	ls fastbatch/_fastbatch_c.*.so >/dev/null 2>&1 || echo "fastbatch: C build failed; the numpy reference path will be used ---> HINT: check gcc and python3-dev"
	touch $@

demo: setup
	PY=$(PY) bash examples/demo.sh

# the embedding example's packages (examples/requirements-embed.txt), for its test and the bench only; where they
# cannot be installed, its test is skipped with the reason
$(EMBED): examples/requirements-embed.txt $(VENV)/.installed
	$(PY) -m pip install -q -r examples/requirements-embed.txt && touch $@ || echo "the embedding example's packages did not install: its test is skipped"

# the media examples' packages (examples/requirements-media.txt), the same way
$(MEDIA): examples/requirements-media.txt examples/requirements-embed.txt $(VENV)/.installed
	$(PY) -m pip install -q -r examples/requirements-media.txt && touch $@ || echo "the media examples' packages did not install: their test is skipped"

test: setup $(EMBED) $(MEDIA)
	AWS_EC2_METADATA_DISABLED=true $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS) tests

bench: setup $(EMBED) $(MEDIA)
	AWS_EC2_METADATA_DISABLED=true $(PY) bench/bench_pool.py
	$(PY) bench/bench_fastbatch.py
	AWS_EC2_METADATA_DISABLED=true $(PY) bench/bench_scale.py
	$(PY) bench/bench_results.py
	$(PY) bench/bench_autoscale.py
	$(PY) bench/bench_dashboard.py
	AWS_EC2_METADATA_DISABLED=true $(PY) bench/bench_churn.py
	$(PY) bench/bench_embed.py
	$(PY) bench/bench_generate.py
	AWS_EC2_METADATA_DISABLED=true $(PY) bench/bench_media_in.py
	$(PY) bench/bench_images.py
	$(PY) bench/fast_paths.py
	$(PY) bench/bench_values.py
	AWS_EC2_METADATA_DISABLED=true $(PY) bench/bench_volume.py
	$(PY) bench/bench_fanout.py

# calque against Celery 5.x (SQS transport, S3 results) on one moto_server, side by side: bench/peers/compare.py;
# then the embedding job and the image job against Ray Data (bench/peers/ray_embed.py, ray_images.py).
# Celery goes in its own venv, which sees $(VENV)'s packages after its own (a .pth file): the demo model's torch
$(PEERS_VENV)/.installed: bench/peers/requirements.txt $(VENV)/.installed
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_PY) -m pip install -q -r bench/peers/requirements.txt
	$(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > \
		"$$($(PEERS_PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/calque-venv.pth"
	touch $@

# and Ray Data in its own venv, which sees $(VENV)'s packages after its own: torch and transformers for the model
$(RAY_VENV)/.installed: bench/peers/requirements-ray.txt $(VENV)/.installed
	$(PYTHON) -m venv $(RAY_VENV)
	$(RAY_PY) -m pip install -q -r bench/peers/requirements-ray.txt
	$(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > \
		"$$($(RAY_PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/calque-venv.pth"
	touch $@

bench-peers: setup $(EMBED) $(MEDIA) $(PEERS_VENV)/.installed $(RAY_VENV)/.installed
	AWS_EC2_METADATA_DISABLED=true PEERS_PY=$(PEERS_PY) $(PY) bench/peers/compare.py
	RAY_PY=$(RAY_PY) $(PY) bench/peers/ray_embed.py
	RAY_PY=$(RAY_PY) $(PY) bench/peers/ray_images.py

# needs a CUDA machine: builds fastbatch, runs its tests, measures pinned vs pageable host-to-device GB/s, and the
# image job (examples/image_embed.py) on the GPU: a 2-worker pool against the loop, the GPU busy fraction
gpu-check: setup $(MEDIA)
	$(PY) fastbatch/gpu_check.py

clean:
	rm -rf .calque .calque-state .calque-demo $(PEERS_VENV) $(RAY_VENV) build calque.egg-info fastbatch/_fastbatch_c.* calque_plain.*.so fastbatch/*.o fastbatch/.build-* $(FASTBATCH_SO)
