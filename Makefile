# Quick start: `make demo` renders examples/prompts.txt on the embedded tiny model; `make test` runs the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch and torchvision must be a matching pair; this pair installs from the local wheel cache on CPU machines.
TORCH_PINS ?= torch==2.14.1 torchvision==0.29.1

PREFIX ?= $(HOME)/.local

.PHONY: demo test install user-install man clean

# The checkout is the package (its root is h3gen): setuptools' note on editable installs of such a layout, that a
# folder named h3gen in the working directory would be imported instead, is true of any package and left out.
$(BIN)/h3gen: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_PINS)
	PYTHONWARNINGS="ignore:Editable installation" $(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(BIN)/h3gen

# h3gen on PATH (PREFIX/bin, ~/.local/bin by default) and its man page where `man h3gen` finds it (man looks in
# PREFIX/share/man for PREFIX/bin on PATH).
user-install: install
	mkdir -p $(PREFIX)/bin $(PREFIX)/share/man/man1
	ln -sf $(abspath $(BIN)/h3gen) $(PREFIX)/bin/h3gen
	cp man/h3gen.1 $(PREFIX)/share/man/man1/h3gen.1

demo: install
	$(BIN)/h3gen render examples/prompts.txt -o out/
	$(BIN)/h3gen validate out/

# Two processes (pytest-xdist), each taking whole test files: most tests wait on h3gen processes they start, so
# two at once finish the suite in about three quarters of the time, also on two cores.
test: install
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

man: install
	$(BIN)/python -m h3gen.cli.manpage > man/h3gen.1

clean:
	rm -rf out
