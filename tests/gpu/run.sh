#!/usr/bin/env bash
# The CUDA smoke test, from the repository root: bash tests/gpu/run.sh [extra pytest arguments]
#
# The project need not be installed: the repository root goes on PYTHONPATH. Needs torch (CUDA),
# lightning, torchmetrics, numpy, pytest and pytest-timeout; not hydra-core / omegaconf (nothing on
# this path imports them). Every result goes to stdout. With $OUT set, the JUnit XML goes there,
# and every rank's report (JSON) and output (log) into $OUT/cuda_smoke_reports/<case>.rank<r>.*.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

python3 -c 'import torch, lightning; print("torch", torch.__version__, "cuda", torch.version.cuda, "lightning", lightning.__version__, "device", torch.cuda.get_device_name() if torch.cuda.is_available() else "none (every test will be skipped)")'

if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,driver_version,compute_mode,memory.used,memory.total --format=csv
fi

base="$(mktemp -d "${TMPDIR:-/tmp}/cuda_smoke.XXXXXX")"  # pytest's tmp_path root: the ranks' folders
junit="${OUT:-$base}/cuda_smoke_junit.xml"
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT"; fi

# -rA: a summary line per test (with each xfail's reason), and the gloo probe's table
python3 -m pytest tests/gpu -v -rA -p no:cacheprovider --timeout 300 --basetemp "$base" --junitxml "$junit" "$@"
status=$?

if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT/cuda_smoke_reports"
    for f in "$base"/cuda_smoke*/*/rank*.json "$base"/cuda_smoke*/*/rank*.log; do
        [ -f "$f" ] && cp "$f" "$OUT/cuda_smoke_reports/$(basename "$(dirname "$f")").$(basename "$f")"
    done
fi
echo "pytest exit status: $status; JUnit XML: $junit; ranks' folders: $base"
exit "$status"
