#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: Debian libraries the Mooncake wheel loads, a venv in
# .venv, torch (CPU build unless an NVIDIA GPU is present), the Mooncake wheel that fits the
# machine, and this package in editable mode with its test and model (transformers) extras.
#   --with vllm   also the vLLM test venv (.venv-vllm): scripts/setup_vllm.sh
set -euo pipefail
cd "$(dirname "$0")/.."
WITH=()
while (($#)); do
    case $1 in
        --with) WITH+=("${2:?--with needs a name: vllm}"); shift 2 ;;
        *) printf '[setup] unknown argument %s (known: --with vllm)\n' "$1" >&2; exit 2 ;;
    esac
done
for w in ${WITH[@]+"${WITH[@]}"}; do
    [ "$w" = vllm ] || { printf '[setup] --with %s: only vllm is known\n' "$w" >&2; exit 2; }
done

with_extras() {   # what --with asked for, once the main venv is in place
    for w in ${WITH[@]+"${WITH[@]}"}; do
        PYTHON="$PYTHON" scripts/setup_"$w".sh
    done
}

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
log() { printf '[setup] %s\n' "$*" >&2; }

# --- Debian packages: libibverbs/librdmacm are loaded by the Mooncake wheel even for TCP;
# iproute2 runs the two-node tests; g++ compiles the cuda-ipc copy kernel's source for the CPU
# (tests/transfer/kernel_cpu.py: the kernel's own code checked byte for byte without a GPU).
DEBS=(libibverbs1 librdmacm1 iproute2 g++)
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

# --- kubectl: tests/deploy builds every overlay with `kubectl kustomize`, whose built-in
# kustomize must be v5 (components, patches by target). Debian's own package
# (kubernetes-client, 1.20: kustomize v2) cannot build them, so where no configured apt
# repository offers `kubectl`, Kubernetes' own signed apt repository (pkgs.k8s.io) is added.
KUBECTL_MINOR=${KUBECTL_MINOR:-v1.32}
kubectl_ok() {
    local v
    v=$(kubectl version --client 2>/dev/null | sed -n 's/^Kustomize Version: v\([0-9][0-9]*\).*/\1/p')
    [ -n "$v" ] && [ "$v" -ge 5 ]
}
if ! kubectl_ok; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq >/dev/null
        if [ -z "$(apt-cache madison kubectl 2>/dev/null)" ]; then
            log "adding Kubernetes' apt repository (pkgs.k8s.io, $KUBECTL_MINOR) for kubectl"
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends curl gpg ca-certificates >/dev/null
            install -d -m 0755 /etc/apt/keyrings
            curl -fsSL "https://pkgs.k8s.io/core:/stable:/$KUBECTL_MINOR/deb/Release.key" \
                | gpg --dearmor --yes -o /etc/apt/keyrings/kubernetes-apt-keyring.gpg
            echo "deb [signed-by=/etc/apt/keyrings/kubernetes-apt-keyring.gpg] https://pkgs.k8s.io/core:/stable:/$KUBECTL_MINOR/deb/ /" \
                >/etc/apt/sources.list.d/kubernetes.list
            apt-get update -qq >/dev/null
        fi
        log "apt-get install kubectl"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends kubectl >/dev/null
        kubectl_ok || { log "the installed kubectl has no kustomize v5: $(kubectl version --client 2>&1 | tr '\n' ' ')"; exit 1; }
    else
        log "missing: kubectl with kustomize v5 (tests/deploy builds the manifests with it)"
        log "install it as root (apt: pkgs.k8s.io), see https://kubernetes.io/docs/tasks/tools/install-kubectl-linux/"
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

# --- already in place? pip takes 16-37 s even when nothing changes, so a stamp in the venv
# records what the last complete set-up installed from: pyproject.toml's hash, whether a GPU
# was seen (it picks torch's build and the extras) and this checkout's path. It is written
# only once everything below succeeded; with the same key, and the venv still importing what
# disagg needs, nothing is installed. A changed pyproject.toml, a new venv or a GPU that
# appeared runs the whole set-up again.
STAMP="$VENV/.disagg-setup-stamp"
key="pyproject.toml $(sha256sum pyproject.toml | cut -d' ' -f1), gpu $has_gpu, $(pwd -P)"
imports_ok() {
    "$PY" -c "import importlib.metadata as m; m.distribution('disagg')
import torch, mooncake.engine, zmq, msgspec, transformers; print('[setup] ok: torch', torch.__version__)" >&2
}
if [ -f "$STAMP" ] && [ "$(head -n 1 "$STAMP")" = "$key" ] && imports_ok 2>/dev/null; then
    log "ok: $(sed -n 2p "$STAMP") already installed (pyproject.toml unchanged); pip not run"
    with_extras
    exit 0
fi
rm -f "$STAMP"

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
if ! imports_ok; then
    log "the venv $VENV cannot import what disagg needs (above)"
    exit 1
fi
printf '%s\n%s\n' "$key" "disagg[test,model,$extra]" >"$STAMP"
with_extras
