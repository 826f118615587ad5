#!/usr/bin/env bash
# Prepare benchmarks/gpu_wheels/ (git-ignored): the wheels benchmarks/gpu_check.sh installs,
# with `pip install --no-index`, on a CUDA machine that has no network.
#
#   benchmarks/gpu_wheels.sh                      # for CPython 3.10-3.14 on x86_64 Linux
#   benchmarks/gpu_wheels.sh --python 3.12        # only the device's python (smaller)
#   benchmarks/gpu_wheels.sh --plots              # also matplotlib, for bench serve's PNG
#   benchmarks/gpu_wheels.sh --arch aarch64       # for an ARM host (e.g. Grace Hopper)
#
# Run it here, where the package registry is reachable (needs uv and pip). It resolves
# benchmarks/gpu_requirements.txt with its dependencies for the target python and platform
# (uv pip compile), leaves out what the device's python already has (torch, triton, numpy,
# cupy, transformers and their dependencies), downloads the rest as binary wheels
# (pip download --no-deps --only-binary=:all:) and writes the pins to
# benchmarks/gpu_wheels/requirements.txt, which gpu_check.sh reads. A device session takes
# the folder along (the device tool's `carry: ["benchmarks/gpu_wheels"]`; ~5 MB per python).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$REPO/benchmarks/gpu_wheels"
PYTHONS="3.10 3.11 3.12 3.13 3.14"
ARCH="x86_64"
PLOTS=0
while [ $# -gt 0 ]; do
  case "$1" in
    --python) PYTHONS="${2//,/ }"; shift 2 ;;
    --arch) ARCH="$2"; shift 2 ;;
    --plots) PLOTS=1; shift ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
export PATH="$HOME/.local/bin:$PATH"
command -v uv >/dev/null || { echo "gpu_wheels.sh needs uv (python3 -m pip install uv)" >&2; exit 2; }
PIP="python3 -m pip"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
cp "$REPO/benchmarks/gpu_requirements.txt" "$TMP/req.in"
[ "$PLOTS" = 1 ] && echo "matplotlib>=3.8" >> "$TMP/req.in"
# Provided by the device's python: torch, triton, numpy, cupy, transformers and what they need.
PROVIDED='^(torch|triton|numpy|cupy.*|fastrlock|transformers|tokenizers|safetensors|huggingface-hub|hf-xet|httpx2|pyyaml|regex|tqdm|sympy|mpmath|networkx|fsspec|filelock|jinja2|markupsafe|setuptools|typing-extensions|packaging|nvidia-.*|cuda-.*)=='
mkdir -p "$OUT"
: > "$TMP/all.txt"
# One resolution, for the oldest python: its pins install on the newer ones too.
LOWEST="$(printf '%s\n' $PYTHONS | sort -V | head -1)"
uv pip compile "$TMP/req.in" --python-version "$LOWEST" --python-platform "${ARCH}-manylinux_2_28" \
  --no-header --no-annotate --quiet -o "$TMP/pins.txt"
grep -v -i -E "$PROVIDED" "$TMP/pins.txt" > "$TMP/download.txt"
for py in $PYTHONS; do
  echo "== wheels for CPython $py ($ARCH)"
  $PIP download --quiet --no-deps --only-binary=:all: --dest "$OUT" \
    --python-version "$py" --implementation cp \
    --platform "manylinux_2_28_${ARCH}" --platform "manylinux_2_17_${ARCH}" \
    --platform "manylinux2014_${ARCH}" --platform "manylinux_2_5_${ARCH}" \
    --platform "manylinux1_${ARCH}" -r "$TMP/download.txt"
done
cp "$TMP/download.txt" "$OUT/requirements.txt"
echo "wrote $(ls "$OUT"/*.whl | wc -l) wheels ($(du -sh "$OUT" | cut -f1)) and $OUT/requirements.txt"
