#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: Debian libraries the Mooncake wheel loads, a venv in
# .venv, torch (CPU build unless an NVIDIA GPU is present), the Mooncake wheel that fits the
# machine, and this package in editable mode with its test and model (transformers) extras.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
log() { printf '[setup] %s\n' "$*" >&2; }

# --- Debian packages: libibverbs/librdmacm are loaded by the Mooncake wheel even for TCP;
# iproute2 runs the two-node tests.
DEBS=(libibverbs1 librdmacm1 iproute2)
missing=()
for p in "${DEBS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        log "apt-get install ${missing[*]}"
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    else
        log "missing Debian packages: ${missing[*]}"
        log "install them as root: apt-get install ${missing[*]}"
        exit 1
    fi
fi

# --- venv
if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
# (grep drops pip warnings about index folders some machines configure but lack)
pip_install() { "$PY" -m pip install -q --disable-pip-version-check "$@" 2> >(grep -v "is ignored: it is neither" >&2); }

has_gpu=0
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then has_gpu=1; fi

# --- torch: never let pip pull a multi-GB CUDA build onto a CPU machine.
if ! "$PY" -c "import torch" 2>/dev/null; then
    if ((has_gpu)); then
        log "installing torch (CUDA build)"
        pip_install torch
    else
        log "installing torch (CPU build)"
        # A CPU wheel in pip's local wheel directories (find-links) first, else PyTorch's
        # CPU index (torch's own dependencies still come from PyPI).
        pyver=$("$PY" -c "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')")
        links="${PIP_FIND_LINKS:-} $("$PY" -m pip config get global.find-links 2>/dev/null || true)"
        wheel=""
        for d in $links; do
            d=${d#file://}
            for w in "$d"/torch-*+cpu-"$pyver"-*.whl; do [ -f "$w" ] && wheel=$w; done
        done
        if [ -n "$wheel" ]; then
            pip_install "$wheel"
        else
            pip_install torch --index-url https://download.pytorch.org/whl/cpu \
                --extra-index-url https://pypi.org/simple
        fi
    fi
fi

# --- Mooncake: the build that fits the machine (all provide the `mooncake` module).
if ((has_gpu)); then
    cuda_major=$("$PY" -c "import torch; print((torch.version.cuda or '12').split('.')[0])")
    if [ "$cuda_major" -ge 13 ]; then extra=mooncake-cuda13,cuda13; else extra=mooncake-cuda,cuda12; fi
else
    extra=mooncake-cpu
fi

log "installing disagg[test,model,$extra] (editable)"
pip_install -e ".[test,model,$extra]"
"$PY" -c "import torch, mooncake.engine, zmq, msgspec, transformers; print('[setup] ok: torch', torch.__version__)" >&2
