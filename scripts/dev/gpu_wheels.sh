#!/usr/bin/env bash
# Wheels for a lent GPU machine (torch installed, no network): download them here, install there.
#
#   scripts/dev/gpu_wheels.sh download [DIR] [PYVER]   # here: DIR defaults to .gpu_wheels
#   scripts/dev/gpu_wheels.sh install  [DIR] [PYTHON]  # there: offline, --no-deps
#
# (`make -f scripts/dev/Makefile gpu-wheels` / `gpu-check` run these; scripts/dev/README.md)
#
# download: every package the project imports at run time except torch/torchvision, pinned to the
# version installed in $PY's environment (default .venv/bin/python), as binary wheels for CPython
# PYVER (default: $PY's version) on manylinux x86_64 ($ARCH overrides the architecture). A package
# with no wheel for its pinned version (antlr4-python3-runtime 4.9.3 is sdist-only) is built here
# with `pip wheel`, which is only accepted when the result is pure Python. Wheels already in DIR
# are kept; DIR is emptied when PYVER/ARCH change (its TARGET file records them).
#
# install: `pip install --no-index --no-deps --find-links DIR <names>`, skipping what is installed
# already; a package whose wheel does not fit that python is reported and the others still go in.
set -euo pipefail

# The GPU checks themselves (pytest -m gpu, scripts/bench/attention.py) need these.
CHECK_PKGS=(numpy faiss-cpu pytest pluggy iniconfig packaging pygments ninja)
# The rest of the project's run-time imports and what importing them pulls in.
RUNTIME_PKGS=(hydra-core omegaconf pyyaml webdataset braceexpand
    open_clip_torch ftfy wcwidth regex timm huggingface_hub safetensors transformers tokenizers
    tqdm httpx2 httpcore2 truststore anyio h11 idna rich markdown-it-py mdurl)
# Published as source only: built here (pure Python) after the others are downloaded.
SDIST_PKGS=(antlr4-python3-runtime)

download() {
    local dir=${1:-.gpu_wheels} py=${PY:-.venv/bin/python} arch=${ARCH:-x86_64}
    local pyver=${2:-$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')}
    local abi="cp${pyver/./}" target="cp${pyver/./}-manylinux-${arch}"
    mkdir -p "$dir"
    if [[ -f "$dir/TARGET" && "$(cat "$dir/TARGET")" != "$target" ]]; then
        echo "gpu_wheels: $dir holds wheels for $(cat "$dir/TARGET"); emptying it for $target"
        rm -f "$dir"/*.whl
    fi
    echo "$target" >"$dir/TARGET"
    local pip=("$py" -m pip -q --disable-pip-version-check)
    local plat=(--platform "manylinux_2_28_$arch" --platform "manylinux_2_27_$arch"
        --platform "manylinux_2_17_$arch" --platform "manylinux2014_$arch")
    local failed=() todo=() pkg ver spec file stem tmp
    for pkg in "${CHECK_PKGS[@]}" "${RUNTIME_PKGS[@]}" "${SDIST_PKGS[@]}"; do
        ver=$("$py" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$pkg" 2>/dev/null || true)
        stem=$(echo "$pkg" | tr 'A-Z.-' 'a-z__')
        if ! ls "$dir" | tr 'A-Z' 'a-z' | grep -q "^${stem}-${ver:-[0-9]}"; then
            todo+=("$pkg${ver:+==$ver}")
        fi
    done
    local binary=() sdist=() t
    for t in "${todo[@]}"; do
        if [[ " ${SDIST_PKGS[*]} " == *" ${t%%==*} "* ]]; then sdist+=("$t"); else binary+=("$t"); fi
    done
    local dl=("${pip[@]}" download --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp
        --abi "$abi" "${plat[@]}" -d "$dir")
    # one resolver run for all (a pip start per package costs seconds); one by one only if it fails
    if ((${#binary[@]})) && "${dl[@]}" "${binary[@]}" 2>/dev/null; then
        printf 'gpu_wheels: %s\n' "${binary[@]}"
        binary=()
    fi
    for spec in "${binary[@]}" "${sdist[@]}"; do
        if "${dl[@]}" "$spec" 2>/dev/null; then
            echo "gpu_wheels: $spec"
            continue
        fi
        tmp=$(mktemp -d)
        if "${pip[@]}" wheel --no-deps -w "$tmp" "$spec" >/dev/null 2>&1 \
            && file=$(ls "$tmp"/*-py3-none-any.whl 2>/dev/null) && [[ -n $file ]]; then
            mv "$file" "$dir/"
            echo "gpu_wheels: $spec (built here: pure Python)"
        else
            failed+=("$spec")
        fi
        rm -rf "$tmp"
    done
    echo "gpu_wheels: $(ls "$dir"/*.whl | wc -l) wheels for $target in $dir, $(du -sh "$dir" | cut -f1)"
    if ((${#failed[@]})); then
        echo "gpu_wheels: no wheel for: ${failed[*]}" >&2
        return 1
    fi
}

install() {
    local dir=${1:-.gpu_wheels} py=${2:-python3} names name failed=()
    if [[ ! -d $dir ]]; then
        echo "gpu_wheels: $dir is missing: run 'make -f scripts/dev/Makefile gpu-wheels' on the dev machine and carry $dir" >&2
        return 2
    fi
    # A lent machine is throw-away: allow installing into an "externally managed" system python.
    export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_DISABLE_PIP_VERSION_CHECK=1
    names=$(ls "$dir" | sed -n 's/^\([^-]*\)-.*\.whl$/\1/p' | sort -u)
    # shellcheck disable=SC2086  # one word per package name
    if "$py" -m pip install -q --no-index --no-deps --find-links "$dir" $names; then
        return 0
    fi
    for name in $names; do  # one bad wheel must not keep the others out
        "$py" -m pip install -q --no-index --no-deps --find-links "$dir" "$name" || failed+=("$name")
    done
    if ((${#failed[@]})); then
        echo "gpu_wheels: could not install: ${failed[*]}" >&2
    fi
}

case ${1:-} in
    download) shift; download "$@" ;;
    install) shift; install "$@" ;;
    *) sed -n '2,5p' "$0" >&2; exit 2 ;;
esac
