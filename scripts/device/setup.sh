# scripts/device/setup.sh, sourced on the device from the repo root (see carry.sh)
# sourced on the device from the repo root: wheels -> /tmp/site, slim Mooncake -> /tmp/mcpy,
# Debian libs -> /tmp/debroot with links in /tmp/fb only for sonames the system lacks
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
mkdir -p /tmp/mcpy /tmp/debroot /tmp/fb
tar xzf .mc/mooncake-slim.tgz -C /tmp/mcpy
for f in .mc/debs/*.deb; do dpkg -x "$f" /tmp/debroot; done
have=$(ldconfig -p | awk '{print $1}')
for f in /tmp/debroot/usr/lib/x86_64-linux-gnu/*.so.* /tmp/debroot/lib/x86_64-linux-gnu/*.so.*; do
  [ -e "$f" ] || continue; n=$(basename "$f")
  echo "$have" | grep -qx "$n" || ln -sf "$f" /tmp/fb/"$n"
done
echo "fallback libs: $(ls /tmp/fb | tr '\n' ' ')"
CUDART=$(find /opt /usr/local -name 'libcudart.so.13*' 2>/dev/null | head -1)
echo "cudart: $CUDART"
export LD_LIBRARY_PATH=/tmp/fb:$(dirname "${CUDART:-/nonexistent/x}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PYTHONPATH=/tmp/site:/tmp/mcpy:$PWD
echo "unresolved for engine.so: $(ldd /tmp/mcpy/mooncake/engine.so | grep 'not found' | tr '\n' ' ')"
