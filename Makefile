# Two commands on a fresh machine (the README's Quickstart):
#   make demo   install torch (CPU build) and fedtrain with its dev extras, then run `fedtrain demo`
#   make test   the test suite, exactly as CI runs it (.ci/run)
# `make install` installs only; `make test-fast` skips the tests that start real processes.

PYTHON ?= python
# The pinned CPU build first: letting pip resolve torch pulls a multi-GB CUDA build.
TORCH ?= torch==2.13.0

export FLWR_TELEMETRY_ENABLED = 0
export FLWR_DISABLE_UPDATE_CHECK = 1
export PIP_DISABLE_PIP_VERSION_CHECK = 1

.PHONY: install demo test test-fast

install:
	$(PYTHON) -m pip install --quiet $(TORCH)
	$(PYTHON) -m pip install --quiet -e ".[dev]"

demo: install
	$(PYTHON) -m fedtrain.cli demo

test:
	$(PYTHON) -m pytest

test-fast:
	$(PYTHON) -m pytest -m "not integration"
