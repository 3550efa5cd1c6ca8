#!/usr/bin/env bash
# The GPU kit: the wheels `python tools/benchmark.py gpu` needs on a lent H200 that its image lacks, built here
# into gpu_kit/ (git-ignored, so it travels only when the device tool's `carry` names it), and the one-line
# command a session passes to that tool's `run`.
#
#     tools/gpu_kit.sh            # builds gpu_kit/, checks it, prints the command as its last line
#     tools/gpu_kit.sh --command  # prints the command only (nothing built)
#
# The device (the device tool's KINDS.md, 2026-11): Python 3.12.3 at /opt/torch/.venv/bin/python3 with torch
# 2.11.0+cu130, transformers 5.17.0, accelerate 1.15.0, peft, pyarrow, safetensors 0.8.0, tokenizers 0.23.2,
# numpy 2.5.2, huggingface_hub 1.33.0, ninja, msgpack, py-cpuinfo, psutil, xxhash, pandas, fsspec, ...; no
# deepspeed, datasets, trl, hjson, pydantic, dill or multiprocess; no network. What it lacks travels here:
# - deepspeed (requirements.txt's pin): no wheel on the registry, so one is built from its sdist with
#   DS_BUILD_OPS=0: pure Python plus the ops' C++/CUDA sources, which it JIT-compiles on first use (the GPU
#   script's runs use torch's fused AdamW and NCCL and load no DeepSpeed op on CUDA; docs/speed.md);
#   its needs hjson and pydantic (+ pydantic-core for cp312, annotated-types, typing-inspection);
# - datasets (+ dill, multiprocess) and trl (the SFT part's TRL SFTTrainer), at requirements.txt's pins;
# - transformers and peft at requirements.txt's pins: the project is tested on transformers 5.23.0, not the
#   image's 5.17.0 (13 MB, pure Python, needs nothing the image lacks), and the image's peft is of an unknown
#   version that must agree with that transformers.
# torch is never carried: the code runs on the image's 2.11 (tools/gpu_kit_rehearse.sh rehearses it on the CPU).
# Every wheel is checked: cp312 manylinux x86_64 or pure Python, one version each, each one's needs met by the
# kit or the image, and the kit plus the tracked tree inside the tool's 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."

KIT=gpu_kit
SITE=/tmp/gpu_kit_site # where the command installs the kit on the device
LIMIT_MIB=64           # what travels with a `run`: the working tree and the carried paths together
# The command, one line: install the kit exactly as the device tool's README does (no index, no deps, a target
# dir), put that dir and the repo (zero_recipes, train.py's package) on PYTHONPATH and its bin/ (the deepspeed
# launcher, which tools/bench/sft/benchmark.py starts) on PATH, offline (nothing can be reached there), and keep
# the log under $OUT even if the tool's time limit kills the pipeline.
COMMAND="set -o pipefail; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE $KIT/*.whl && export PYTHONPATH=$SITE:\$PWD PATH=$SITE/bin:\$PATH HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 && python3 tools/benchmark.py gpu --out-dir \$OUT 2>&1 | tee \$OUT/gpu-log.txt"

# The image's packages (KINDS.md, as read on a machine running it on 2026-11-17), and the versions of those its
# pip list showed; a kit wheel's need on one of them is met by the image.
DEVICE_PACKAGES="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite
lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas
nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand
nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink
nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks
pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy
seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp"
DEVICE_VERSIONS="accelerate==1.15.0 huggingface-hub==1.33.0 numpy==2.5.2 safetensors==0.8.0 tokenizers==0.23.2
torch==2.11.0 transformers==5.17.0 triton==3.6.0"

case "${1:-}" in
--command)
    echo "$COMMAND"
    exit 0
    ;;
--device-packages)
    echo $DEVICE_PACKAGES
    exit 0
    ;;
"") ;;
*)
    echo "usage: tools/gpu_kit.sh [--command | --device-packages]" >&2
    exit 2
    ;;
esac

PY=${PYTHON:-python3}
pin() { # NAME: its exact pin in requirements.txt (the one source of versions)
    local line
    line=$(grep -iE "^$1==" requirements.txt) || {
        echo "error: requirements.txt pins no $1" >&2
        exit 2
    }
    echo "$line"
}
# pinned by requirements.txt: what the project is tested with
PINNED="$(pin transformers) $(pin peft) $(pin datasets) $(pin trl)"
DEEPSPEED=$(pin deepspeed)
# their needs the image lacks, not in requirements.txt: the versions the CPU suite resolves with those pins
NEEDS="hjson==3.1.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2"
NEEDS+=" dill==0.4.1 multiprocess==0.70.19"

rm -rf "$KIT" && mkdir -p "$KIT"
echo "downloading $PINNED $NEEDS (cp312 manylinux x86_64 or pure Python) ..."
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$KIT" $PINNED $NEEDS
echo "building $DEEPSPEED's wheel from its sdist (DS_BUILD_OPS=0: no op compiled ahead, each one JIT) ..."
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-cache-dir --no-binary deepspeed -w "$KIT" "$DEEPSPEED"

# Check the kit: tags, one version each, every need met, the size.
"$PY" - "$KIT" "$DEVICE_PACKAGES" "$DEVICE_VERSIONS" "$LIMIT_MIB" <<'EOF'
import re
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
except ImportError:  # pip always vendors it
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename

kit, device, known, limit_mib = Path(sys.argv[1]), sys.argv[2].split(), sys.argv[3].split(), int(sys.argv[4])
device = {canonicalize_name(n) for n in device}
known = {canonicalize_name(n): v for n, v in (x.split("==") for x in known)}
# the device: CPython 3.12 on Linux x86_64
env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "platform_system": "Linux",
       "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "extra": ""}
wheels, problems = {}, []
for path in sorted(kit.glob("*.whl")):
    name, version, _, tags = parse_wheel_filename(path.name)
    if name in wheels:
        problems.append(f"two versions of {name}: {wheels[name][0]} and {version}")
    ok = all(t.interpreter in ("py3", "cp312", "py312") and t.abi in ("none", "abi3", "cp312")
             and (t.platform == "any" or re.fullmatch(r"manylinux(1|2010|2014|_2_\d+)_x86_64", t.platform)) for t in tags)
    if not ok:
        problems.append(f"{path.name}: not for CPython 3.12 on manylinux x86_64")
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        needs = Parser().parsestr(z.read(meta).decode()).get_all("Requires-Dist") or []
        if name == "deepspeed":
            compiled = [n for n in z.namelist() if n.endswith((".so", ".pyd"))]
            if compiled or any(t.platform != "any" for t in tags):
                problems.append(f"{path.name} is not pure Python: {compiled[:3]}")
            if not any(n.endswith("csrc/adam/multi_tensor_adam.cu") for n in z.namelist()):
                problems.append(f"{path.name} lacks the ops' sources its JIT builds compile")
    wheels[name] = (version, needs, path.stat().st_size)
for name, (version, needs, _) in wheels.items():
    for text in needs:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate(env):
            continue  # another platform's, or an extra's
        dep = canonicalize_name(req.name)
        if dep in wheels:
            have, where = str(wheels[dep][0]), "the kit"
        elif dep in known:
            have, where = known[dep], "the device"
        elif dep in device:
            continue  # on the device, at a version nobody read: not checkable here
        else:
            problems.append(f"{name} {version} needs {req}: neither in the kit nor on the device")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            problems.append(f"{name} {version} needs {req}: {where} has {dep} {have}")
tree = sum(int(x.split()[0]) for x in subprocess.run(
    "git ls-files -z --cached --others --exclude-standard | xargs -0 -r du -b --apparent-size 2>/dev/null || true",
    shell=True, capture_output=True, text=True).stdout.splitlines())
size = sum(w[2] for w in wheels.values())
for name, (version, _, nbytes) in sorted(wheels.items(), key=lambda x: -x[1][2]):
    print(f"  {nbytes / 2**20:6.2f} MiB  {name} {version}")
print(f"kit: {len(wheels)} wheels, {size / 2**20:.1f} MiB; with the working tree ({tree / 2**20:.1f} MiB) "
      f"{(size + tree) / 2**20:.1f} MiB of the {limit_mib} MiB a run carries")
if size + tree > limit_mib * 2**20:
    problems.append(f"the kit and the tree are {(size + tree) / 2**20:.1f} MiB, over {limit_mib} MiB")
for p in problems:
    print(f"error: {p}", file=sys.stderr)
sys.exit(1 if problems else 0)
EOF

cat <<EOF
The device tool's run, with carry ["$KIT"] and timeout_s 600 (the script keeps to its own 7.5-minute budget;
results come back from \$OUT: gpu-DATE.md, gpu-DATE.json, gpu-log.txt). The command, one line:
EOF
echo "$COMMAND"
