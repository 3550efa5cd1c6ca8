#!/usr/bin/env bash
# Rehearse the GPU kit on this CPU machine: a Python 3.12 virtual environment holding the lent H200's packages
# at its versions (torch 2.11.0, transformers 5.17.0, ...; the CUDA build of torch 2.11 from the registry, which
# runs on the CPU here), nothing the image lacks, then the kit (tools/gpu_kit.sh) installed and run by the very
# command it prints for the device, with --quick (every part on the CPU, tiny shapes) and $OUT a local folder.
#
#     tools/gpu_kit_rehearse.sh          # ~15 min on 2 cores the first time (5 GB venv, DeepSpeed's CPU ops JIT)
#
# Environment: GPU_KIT_VENV (default /tmp/gpu-kit-venv312, kept and reused while its package list is the same),
# GPU_KIT_OUT (default /tmp/kit-out: gpu-DATE.{md,json} and gpu-log.txt), PYTHON312 (a python3.12 to make it).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${GPU_KIT_VENV:-/tmp/gpu-kit-venv312}
OUT=${GPU_KIT_OUT:-/tmp/kit-out}
# The image's versions where its pip list showed them (the device tool's KINDS.md), else the registry's that fit
# the same date: torch's wheel from the registry is the same cu130 build as the image's, with its CUDA libraries.
BASE="torch==2.11.0 transformers==5.17.0 accelerate==1.15.0 safetensors==0.8.0 tokenizers==0.23.2 numpy==2.5.2"
BASE+=" huggingface_hub==1.33.0 triton==3.6.0 peft==0.21.2 pyarrow==26.0.1 fsspec==2026.9.0 pandas xxhash aiohttp"
BASE+=" requests httpx filelock msgpack ninja py-cpuinfo psutil pyyaml tqdm einops nvidia-ml-py packaging jinja2"
BASE+=" typer regex tensorboard"

started=$(date +%s)
if [ "$(cat "$VENV/.device-base" 2>/dev/null)" != "$BASE" ]; then
    PY=${PYTHON312:-}
    for p in python3.12 /root/.pyenv/versions/3.12*/bin/python3.12; do
        [ -n "$PY" ] && break
        if "$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then PY=$p; fi
    done
    [ -n "$PY" ] || {
        echo "error: no python3.12 here (set PYTHON312)" >&2
        exit 2
    }
    echo "making $VENV with $PY: $BASE"
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
    # shellcheck disable=SC2086
    "$VENV/bin/python" -m pip install -q $BASE
    # What pip brought that the image lacks (newer typer and python-dateutil need pydantic and tzdata; the
    # image's do not) goes: the rehearsal must not pass on a package the device does not have.
    extra=$("$VENV/bin/python" -I - "$(tools/gpu_kit.sh --device-packages)" <<'EOF'
import sys
from importlib.metadata import distributions

from pip._vendor.packaging.utils import canonicalize_name

device = {canonicalize_name(n) for n in sys.argv[1].split()}
print(" ".join(sorted({canonicalize_name(d.metadata["Name"]) for d in distributions()} - device)))
EOF
)
    if [ -n "$extra" ]; then
        echo "removing what the image lacks: $extra"
        # shellcheck disable=SC2086
        "$VENV/bin/python" -m pip uninstall -q -y $extra
    fi
    echo "$BASE" >"$VENV/.device-base"
fi
"$VENV/bin/python" -m pip list --format=freeze 2>/dev/null | grep -iE '^(torch|transformers|accelerate|peft|pyarrow|safetensors|tokenizers|numpy|huggingface.hub)==' | tr '\n' ' '
echo

tools/gpu_kit.sh
command=$(tools/gpu_kit.sh --command)
quick=${command/tools\/benchmark.py gpu --out-dir/tools/benchmark.py gpu --quick --out-dir}
[ "$quick" != "$command" ] || {
    echo "error: the command has no 'tools/benchmark.py gpu --out-dir' to add --quick to: $command" >&2
    exit 2
}
site=$(sed -E 's/.*--target ([^ ]+) .*/\1/' <<<"$command")
rm -rf "$site" "$OUT" && mkdir -p "$OUT"
echo "rehearsing, with python3 = $VENV/bin/python3 and OUT=$OUT: $quick"
set +e
env -u PYTHONPATH -u VIRTUAL_ENV PATH="$VENV/bin:$PATH" OUT="$OUT" bash -c "$quick"
rc=$?
set -e
echo "rehearsal: exit $rc in $(($(date +%s) - started)) s; $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $rc
