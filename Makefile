# kvstore: `make demo` and `make test` work on a fresh machine with Python 3.10+ and make.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test imports layout types test-lowest lint format docs stress bench bench-quick bench-peer clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip uninstall -q -y kvstore 2>/dev/null || true  # the distribution's old name
	$(PY) -m pip install -q -e '.[test,bench,fleet,integrations,llm]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m bench.demo

test: $(STAMP)
	$(VENV)/bin/ruff check kvstore daemon client tests bench
	$(MAKE) imports
	$(MAKE) types
	$(PY) -m pytest -q tests

# The import contracts in pyproject.toml ([tool.importlinter]: the core imports neither the client
# nor the daemon, the client not the daemon, no import circles). import-linter finds packages where
# Python finds them, and in this checkout kvstore.client and kvstore.daemon exist only through
# the editable install's package-dir mapping (client/ and daemon/), which it does not follow. So it
# reads a copy laid out as the wheel installs it: setuptools' build_py copies kvstore/, client/
# and daemon/ to build/il/kvstore/{,client/,daemon/} (offline, about a second), and lint-imports
# runs there, where the copy comes first on sys.path.
imports: layout
	cd build/il && ../../$(VENV)/bin/lint-imports ../../pyproject.toml

layout: $(STAMP)
	rm -rf build/il
	$(PY) -W ignore -c 'import sys; from setuptools import setup; \
		sys.argv = ["setup.py", "-q", "build_py", "--build-lib", "build/il"]; setup()'

# mypy ([tool.mypy] in pyproject.toml) over kvstore, kvstore.client and kvstore.daemon, in the
# same wheel layout as `imports` (mypy, too, finds packages where Python finds them).
types: layout
	cd build/il && ../../$(VENV)/bin/mypy --config-file ../../pyproject.toml

# The lowest supported mlx / mlx-lm (pyproject's floors) in a second venv; `make test` gets the
# highest. `.ci/run` runs both.
LOWEST := mlx==0.31.2 mlx-lm==0.31.3
LOW_VENV := .venv-lowest

$(LOW_VENV)/.installed: pyproject.toml
	test -x $(LOW_VENV)/bin/python || $(PYTHON) -m venv $(LOW_VENV)
	$(LOW_VENV)/bin/python -m pip install -q --upgrade pip
	$(LOW_VENV)/bin/python -m pip install -q -e '.[test,fleet,integrations,llm]' $(LOWEST)
	touch $@

test-lowest: $(LOW_VENV)/.installed
	$(LOW_VENV)/bin/python -m pytest -q tests

lint: $(STAMP)
	$(VENV)/bin/ruff check kvstore daemon client tests bench
	$(VENV)/bin/ruff format --check kvstore daemon client tests bench

format: $(STAMP)
	$(VENV)/bin/ruff format kvstore daemon client tests bench

# the CLI reference, generated from each command's --help (tests/cli/test_cli_reference.py checks it)
docs: $(STAMP)
	$(PY) -m kvstore.cli.reference > docs/cli.md

# the reliability battery at full scale (tests/reliability); figures go to
# bench/results/reliability.json. `make test` runs the same tests at their quick scale.
stress: $(STAMP)
	KVSTORE_STRESS=1 $(PY) -m pytest -q tests/reliability

bench: $(STAMP)
	$(PY) -m bench.run --full

# about 4-5 minutes on a shared 2-core box; `make bench-quick REFERENCE=1` refreshes bench/results/reference
bench-quick: $(STAMP)
	$(PY) -m bench.run --quick $(if $(REFERENCE),--reference)

# kvstore serve against vllm-mlx 0.6.0 and Rapid-MLX 0.16.10 after restarts, on a plain-attention
# and a hybrid model (bench/peer.py), then what survives a SIGKILL (bench.peer_crash) and a copied
# or changed model folder (bench.peer_change): ~35 min here. Each peer lives in a venv of its own
# (several GB with torch, outside the checkout), set up here when missing; a peer that cannot be
# set up is said in one line and left out, the rest is measured.
PEER_VENV ?= $(or $(KVSTORE_PEER_VENV),$(HOME)/.cache/kvstore-bench/peer-venv)
RAPID_VENV ?= $(or $(KVSTORE_RAPID_VENV),$(HOME)/.cache/kvstore-bench/rapid-venv)
bench-peer: $(STAMP)
	@test -x "$(PEER_VENV)/bin/vllm-mlx" || { echo "bench-peer: setting up vllm-mlx 0.6.0 in $(PEER_VENV)"; \
	  $(PYTHON) -m venv "$(PEER_VENV)" && "$(PEER_VENV)/bin/pip" install -q vllm-mlx==0.6.0 'mlx[cpu]' \
	  || echo "bench-peer: the install of vllm-mlx 0.6.0 into $(PEER_VENV) failed (above)"; }
	@test -x "$(RAPID_VENV)/bin/rapid-mlx" || { echo "bench-peer: setting up Rapid-MLX 0.16.10 in $(RAPID_VENV)"; \
	  $(PYTHON) -m venv "$(RAPID_VENV)" && "$(RAPID_VENV)/bin/pip" install -q rapid-mlx==0.16.10 'mlx[cpu]' \
	  || echo "bench-peer: the install of Rapid-MLX 0.16.10 into $(RAPID_VENV) failed (above)"; }
	KVSTORE_PEER_VENV=$(abspath $(PEER_VENV)) KVSTORE_RAPID_VENV=$(abspath $(RAPID_VENV)) \
	  $(PY) -m bench.run --quick --only peer,peer_crash,peer_change --out peer

# issue 32: boxes (each its own daemon and `kvstore serve`) behind a round-robin balancer over one
# real weed, read-through off, on and through a throttled link (docs/fleet.md); QUICK=1 is 2 boxes,
# 2 chats of 4 turns; OUT=DIR also writes DIR/fleet-readthrough.{json,txt}
.PHONY: bench-readthrough
bench-readthrough: $(STAMP)
	$(PY) -m bench.fleet_readthrough $(if $(QUICK),--quick) $(if $(OUT),--out $(OUT))

# the restart path at Qwen3.5-9B's shapes (8-bit random weights made on the spot), for an
# accelerator: `make bench-gpu` here, or `OUT=DIR bash bench/gpu_device.sh` on a CUDA box (it makes
# its own venv with 'mlx[cuda12]'); `make bench-gpu TINY=1` is the smoke test's tiny run
.PHONY: bench-gpu
bench-gpu: $(STAMP)
	$(PY) -m bench.gpu $(if $(TINY),--tiny) --out bench/results/gpu.json

clean:
	rm -rf $(VENV) $(LOW_VENV) .demo .pytest_cache build
