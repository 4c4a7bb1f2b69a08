#!/usr/bin/env bash
# The planner's accuracy on a lent accelerator machine (one GPU, many cores), in one call:
#   1. on the GPU alone: profile, predict and measure the one-device plans of a GPT big enough for
#      the GPU to compute (planner_accuracy.py --devices 1);
#   2. on two CPU processes with half the cores each (the same script's default cluster), on a
#      machine nobody else is using.
# Writes what it prints and the JSON rows under $OUT (default /tmp/jpipe_device).
#
#   bash experiments/device_run.sh
#
# Uses the machine's own jax; carries flax/optax wheels in .whl/ (if present) for when the
# machine's versions are outside jpipe's pins.
set -u
OUT=${OUT:-/tmp/jpipe_device}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
PY=${PY:-python3}

in_pins='import flax, optax, sys
v = lambda m: tuple(int(x) for x in m.__version__.split(".")[:2])
sys.exit(0 if (0, 12) <= v(flax) < (0, 14) and (0, 2) <= v(optax) < (0, 4) else 1)'
if ! $PY -c "$in_pins" && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/jpipe_site .whl/*.whl
  export PYTHONPATH=$PWD:/tmp/jpipe_site
fi
$PY -c 'import jax, flax, optax, numpy, os; print("jax", jax.__version__, "flax", flax.__version__,
"optax", optax.__version__, "numpy", numpy.__version__, jax.devices(), os.cpu_count(), "cores")' 2>&1 \
  | tee "$OUT/versions.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$OUT/versions.txt" 2>&1

timeout "${GPU_TIMEOUT:-200}" $PY experiments/planner_accuracy.py --devices 1 --d-model 1024 --heads 16 \
  --layers 8 --seq-len 256 --batch-size 32 --json "$OUT/gpu1.json" 2>&1 | tee "$OUT/gpu1.txt"
echo "gpu run: exit ${PIPESTATUS[0]}"

JAX_PLATFORMS=cpu timeout "${CPU_TIMEOUT:-400}" $PY experiments/planner_accuracy.py --json "$OUT/cpu2.json" 2>&1 \
  | tee "$OUT/cpu2.txt"
echo "cpu run: exit ${PIPESTATUS[0]}"
