#!/usr/bin/env bash
# make demo: a local pool of the demo model with 2 warm workers, 3 runs against it, one cold run as the
# baseline, the pool's status and the runs' costs side by side, then its workers stopped: the store stays for
# `calque dashboard` to draw (the pool is deleted on failure, and by the next `make demo`).
set -euo pipefail
PY=${PY:-.venv/bin/python}
export CALQUE_STORE=.calque-demo CALQUE_STATE=.calque-demo/state
trap '$PY calque.py pool delete --model demo --yes --force >/dev/null 2>&1 || true' EXIT
$PY calque.py pool delete --model demo --yes --force >/dev/null 2>&1 || true
rm -rf .calque-demo   # the demo's own store: start from nothing each time
$PY calque.py pool create --model demo --handler examples/demo_model.py:DemoModel --workers 2 --batch-size 8
for i in 1 2 3; do
  echo; $PY calque.py submit --pool demo examples/items.jsonl --claim-size 10
done
echo; echo "cold baseline: one fresh worker pays process start + @enter for the same items"
$PY calque.py submit --model demo examples/items.jsonl --claim-size 10
echo; $PY calque.py pool status --model demo
echo; echo "what each run cost (warm pool runs against the cold baseline):"
$PY calque.py cost $($PY calque.py runs list --json | $PY -c 'import json, sys; print(" ".join(r["run_id"] for r in json.load(sys.stdin)))')
echo; $PY calque.py pool cost --model demo
echo; $PY calque.py pool scale --model demo --workers 0
trap - EXIT
echo; echo "see it drawn: CALQUE_STORE=.calque-demo $(dirname "$PY")/calque dashboard   (then open http://127.0.0.1:8265/)"
