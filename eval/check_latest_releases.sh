#!/usr/bin/env bash
# Drift check (not CI): install the newest releases of specdraft's dependencies, without
# constraints.txt, into a throwaway venv, and run a smoke subset of the tests. CI and the README's
# commands install the exact set in constraints.txt, so a new transformers (or accelerate, peft, ...)
# release cannot break a fresh clone overnight; this script says early whether the next one will.
#
#   bash eval/check_latest_releases.sh [VENV_DIR [REQUIREMENT ...]]   (default /tmp/specdraft-latest; ~7 min)
#
# REQUIREMENTs (e.g. transformers==5.0.0) are installed last, to try a lower bound instead of the newest.
# It prints the versions it got and, beside each, the pinned one; exit status is pytest's.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-/tmp/specdraft-latest}
shift || true
rm -rf "$venv"
python3 -m venv "$venv"
. "$venv/bin/activate"
pip install -q torch==2.13.0                 # the CPU build, as the README pins it
pip install -q -U -e '.[test]'               # everything else: the newest releases the ranges allow
if [ $# -gt 0 ]; then pip install -q "$@" torch==2.13.0; fi   # a bound to try (the CPU torch kept)
echo "package          newest        pinned (constraints.txt)"
for name in transformers accelerate peft datasets safetensors tokenizers triton deepspeed wandb; do
  newest=$(pip show "$name" 2>/dev/null | awk '/^Version:/{print $2}')
  pinned=$(grep -i "^$name==" constraints.txt | cut -d= -f3)
  printf '%-16s %-13s %s\n' "$name" "${newest:-missing}" "${pinned:-?}"
done
# The smoke subset: recipes, the loop (resume, overwrite rules), decoding, exports and the wheel.
pytest -q -n 2 -p no:cacheprovider tests/test_config.py tests/test_train.py tests/test_nothing_lost.py \
  tests/test_speculative.py tests/test_export.py tests/test_install.py
