#!/usr/bin/env bash
# Sourced by the scripts that install Python packages into a virtual environment of their own (install-torch.sh,
# install-python-tools.sh): `volt_venv DIR` creates DIR as a virtual environment if it is not one yet, installing
# Debian's python3-venv first where `python3 -m venv` needs it. `volt_venv DIR PYTHON FLAGS...` makes it from PYTHON
# with venv's FLAGS (--system-site-packages).
volt_venv() {
  local venv=$1 python=${2:-} fallback=${2:-/usr/bin/python3}
  shift $(( $# < 2 ? $# : 2 ))
  [ -x "$venv/bin/python" ] && return 0
  [ -n "$python" ] || python=$(command -v python3 || true)
  [ -n "$python" ] || { echo "volt: python3 is needed here (apt-get install python3 python3-venv)" >&2; return 1; }
  mkdir -p "$(dirname "$venv")"
  if ! "$python" -m venv "$@" "$venv" >/dev/null 2>&1; then
    rm -rf "$venv"
    echo "volt: installing python3-venv" >&2
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq python3-venv >&2
    "$fallback" -m venv "$@" "$venv"
  fi
}
