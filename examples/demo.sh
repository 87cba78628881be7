#!/usr/bin/env bash
# make demo: a local pool of the demo model with 2 warm workers, 3 runs against it, one cold run as the
# baseline, the pool's status and cost, then the pool deleted (also when a step fails).
set -euo pipefail
PY=${PY:-.venv/bin/python}
export CALQUE_STORE=${CALQUE_STORE:-.calque-demo} CALQUE_STATE=${CALQUE_STATE:-.calque-demo/state}
trap '$PY calque.py pool delete --model demo --yes >/dev/null 2>&1 || true' EXIT
$PY calque.py pool delete --model demo --yes >/dev/null 2>&1 || true
$PY calque.py pool create --model demo --handler examples/demo_model.py:DemoModel --workers 2 --batch-size 8
for i in 1 2 3; do
  echo; $PY calque.py submit --pool demo examples/items.jsonl --claim-size 10
done
echo; echo "cold baseline: one fresh worker pays process start + @enter for the same items"
$PY calque.py submit --model demo examples/items.jsonl --claim-size 10
echo; $PY calque.py pool status --model demo
echo; $PY calque.py pool delete --model demo --yes
