# Quick start: `make demo` renders examples/prompts.txt on the embedded tiny model; `make test` runs the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch and torchvision must be a matching pair; this pair installs from the local wheel cache on CPU machines.
TORCH_PINS ?= torch==2.14.1 torchvision==0.29.1

.PHONY: demo test install man clean

$(BIN)/h3gen: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_PINS)
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(BIN)/h3gen

demo: install
	$(BIN)/h3gen render examples/prompts.txt -o out/
	$(BIN)/h3gen validate out/*.mp4

test: install
	$(BIN)/python -m pytest -q

man: install
	$(BIN)/python -m h3gen.cli.manpage > man/h3gen.1

clean:
	rm -rf out
