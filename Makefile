# Two commands on a fresh clone: `make demo` and `make test` (`make venv` sets up alone).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Re-install when pyproject.toml changes, not on every make call.
STAMP := $(VENV)/.zeroshard-installed
TESTS ?= tests/
# Two pytest workers, each test file on one of them (its module-scoped spawned worlds stay shared):
# most tests wait on rank processes, interpreter starts and sockets, so one worker leaves a core idle.
TEST_WORKERS ?= 2

.PHONY: venv demo test lint

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# torch is pinned only here, and only when missing: pip must never resolve the open
	@# `torch>=2.6` range itself (it would pick whatever index it sees first).
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	@# hf: transformers; test adds peft, datasets and torchft. With torch installed first, their
	@# torch requirement is already met, so the pin holds.
	$(PY) -m pip install -q -e '.[test,hf,lint]'
	@touch $(STAMP)

# 2 gloo ranks, tiny GPT on the synthetic Markov source; loss heads for the printed entropy floor.
demo: venv
	$(VENV)/bin/zeroshard train --model tiny --stage 3 --nproc 2 \
		--batch 32 --seq-len 64 --steps 800 --lr 6e-3 --min-lr 6e-4 --warmup 20 \
		--log-every 80

# pytest exits 5 when nothing was collected; that must fail CI, never pass it.
test: venv
	@$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(TESTS) ; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: no tests were collected; failing" >&2; exit 1; fi; \
	exit $$rc

# ruff (style, and SLF001: no reads of another class's _private fields), mypy over the package, and the
# room order: each room of zeroshard/ imports only the rooms below it (scripts/check_rooms.py).
# Test folders have no __init__.py, so pytest imports each test module by its basename: two
# files of one name in different folders break collection. Fail here, with the names, instead.
lint: venv
	@dups=$$(find tests -name 'test_*.py' -printf '%f\n' | sort | uniq -d); \
	if [ -n "$$dups" ]; then echo "lint: test files share a basename; rename one of each: $$dups" >&2; exit 1; fi
	$(VENV)/bin/ruff check zeroshard tests bench scripts
	$(VENV)/bin/mypy
	$(PY) scripts/check_rooms.py
