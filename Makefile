# Two commands for a fresh machine: `make demo` (the controlled experiment, ending in a report)
# and `make test`. Both create the virtual environment on first use. `make docs` builds the site.
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch goes in first: a plain `torch` requirement with no torch installed
# pulls a multi-GB CUDA build. Override TORCH to use another build.
TORCH ?= torch==2.13.0
# Small models run fastest on one thread; several threads per process thrash a shared machine.
export OMP_NUM_THREADS ?= 1
# The demo's outputs stay beside the checkout for the user to open, under runs/, which git
# ignores (nothing shows in `git status`, nothing tracked is touched) and `make clean` removes.
DEMO_OUT ?= runs/demo
REPRODUCE_OUT ?= runs/reproduce

.PHONY: demo reproduce test lint format bench docs clean

$(BIN)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

demo: $(BIN)/.installed
	$(BIN)/dynamics run configs/teacher_student.yaml --out $(DEMO_OUT) --overwrite
	$(BIN)/dynamics plane $(DEMO_OUT)/unshifted.h5 $(DEMO_OUT)/shifted.h5 -o $(DEMO_OUT)/plane.html --overwrite --no-progress
	$(BIN)/dynamics compare $(DEMO_OUT)/unshifted.h5 $(DEMO_OUT)/shifted.h5 -o $(DEMO_OUT)/compare.html --overwrite
	@echo "Results: $(DEMO_OUT)/compare.html (side by side), $(DEMO_OUT)/plane.html (gradient plane), run files $(DEMO_OUT)/*.h5"

# The paper's experiments over seeds and the report of its claims (runs/reproduce/reproduce.html);
# `dynamics reproduce --quick` is the ten-minute version.
reproduce: $(BIN)/.installed
	$(BIN)/dynamics reproduce --out $(REPRODUCE_OUT) --overwrite

# One worker per core: the tests are single-threaded (OMP_NUM_THREADS=1 above).
test: $(BIN)/.installed
	$(BIN)/pytest -n auto

# import-linter reads the package from disk; the copy under build/ lays it out as installed.
lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	rm -rf build/layers && mkdir -p build/layers
	cp -r dynamics build/layers/dynamics
	cp -r callbacks build/layers/dynamics/callbacks
	cp -r analysis build/layers/dynamics/analysis
	cd build/layers && PYTHONPATH=. ../../$(BIN)/lint-imports --config ../../pyproject.toml

format: $(BIN)/.installed
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The docs site into build/site, strictly: a broken link or API reference fails the build.
docs: $(BIN)/.docs-installed
	$(BIN)/mkdocs build --strict

$(BIN)/.docs-installed: $(BIN)/.installed
	$(BIN)/python -m pip install -q -e ".[docs]"
	touch $@

bench: $(BIN)/.installed
	for script in benchmarks/*.py; do $(BIN)/python $$script || exit 1; done

clean:
	rm -rf $(VENV) runs build *.egg-info
