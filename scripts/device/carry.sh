#!/usr/bin/env bash
# Builds, on this (CPU) machine, what a GPU run on a lent device machine needs that its image
# lacks: .whl/ (cp312 wheels: pyzmq, msgspec, aiohttp and its deps, prometheus-client, tqdm,
# hypothesis, pytest-timeout; and the transformers + tokenizers of the `model` extra: the image's
# transformers is another minor, which the model engine refuses) and .mc/ (a slim Mooncake cuda13 build: engine.so and the libraries
# it loads, 9 MB of the 50 MB wheel; Debian's libibverbs/librdmacm and their deps). Both folders
# are git-ignored through .git/info/exclude; name them in the device tool's `carry`, then on the
# device: `source scripts/device/setup.sh` and run (scripts/device/checks.sh does the usual).
set -euo pipefail
cd "$(dirname "$0")/../.."
for d in /.whl/ /.mc/; do grep -qx "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
PIP=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
mkdir -p .whl .mc/debs
for p in pyzmq msgspec aiohttp multidict yarl propcache frozenlist aiosignal aiohappyeyeballs attrs \
         prometheus-client tqdm hypothesis sortedcontainers pytest-timeout transformers tokenizers; do
    v=$(.venv/bin/python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$p")
    ls .whl | grep -qi "^${p//-/_}-$v-" || "${PIP[@]}" -d .whl "$p==$v"
done
if [ ! -f .mc/mooncake-slim.tgz ]; then
    tmp=$(mktemp -d)
    "${PIP[@]}" -d "$tmp" mooncake-transfer-engine-cuda13
    (cd "$tmp" && unzip -q ./*.whl 'mooncake/__init__.py' 'mooncake/engine.so' 'mooncake/libasio.so' \
        'mooncake/libetcd_wrapper.so' 'mooncake_transfer_engine_cuda13.libs/libyaml-cpp-*' \
        'mooncake_transfer_engine_cuda13.libs/libgflags-*' 'mooncake_transfer_engine_cuda13.libs/libjsoncpp-*' \
        'mooncake_transfer_engine_cuda13.libs/libglog-*' && tar czf mooncake-slim.tgz mooncake mooncake_transfer_engine_cuda13.libs)
    mv "$tmp/mooncake-slim.tgz" .mc/ && rm -rf "$tmp"
fi
(cd .mc/debs && ls ./*.deb >/dev/null 2>&1 || apt-get download ibverbs-providers libbrotli1 libcom-err2 libcurl4 \
    libffi8 libgmp10 libgnutls30 libgssapi-krb5-2 libhogweed6 libibverbs1 libidn2-0 libk5crypto3 libkeyutils1 \
    libkrb5-3 libkrb5support0 libldap-2.5-0 libnettle8 libnghttp2-14 libnl-3-200 libnl-route-3-200 libnuma1 \
    libp11-kit0 libpsl5 librdmacm1 librtmp1 libsasl2-2 libssh2-1 libssl3 libtasn1-6 libunistring2 libzstd1 zlib1g)
du -sh .whl .mc
