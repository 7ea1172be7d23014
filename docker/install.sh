#!/bin/sh
# The Python half of both images (docker/Dockerfile, docker/Dockerfile.cuda), run from the folder holding the
# package's source (pyproject.toml, README.md, src/): PyTorch first, then scalenlp with every extra its commands use.
#
#   TORCH             the torch requirement to install first; empty: keep the torch already there (the CUDA image's)
#   TORCH_INDEX_URL   where that torch comes from; empty: pip's own index. The CPU image names PyTorch's CPU index,
#                     whose wheels leave out the CUDA libraries PyPI's torch brings (gigabytes a CPU never uses).
#   EDITABLE          non-empty: install the package editable (the Makefile's .venv, whose source is worked on)
#
# Torch goes first so that the package's `torch>=2.11` is already met and pip does not fetch another build.
# `make setup` builds the repository's .venv with this script, so CI runs it on every change.
set -eu

if [ -n "${TORCH:-}" ]; then
    python -m pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH"
fi
python -m pip install ${EDITABLE:+-e} ".[all]"
scalenlp --help >/dev/null  # the entry point the images run
