#!/usr/bin/env bash
# Set up spindle and generate with the built-in demo model (shipped in the package; no download).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
spindle generate "def fibonacci(n):" "${@}"
