"""A process that owns two CPU regions exposed over the cma transport, for tests of writes into
another process's memory (tests/transfer/test_cma.py). Not a test module.

    python -m harness.cma_owner SIZE      (PYTHONPATH=.:tests)
    -> one JSON line: its offer {"kind", "host", "blob" (hex)}
    <- "dump"   -> one JSON line {"hex": both regions' bytes}
    <- "exit"   -> exits
Region 0 holds bytes 0, 1, 2, ... (mod 251), region 1 bytes 250, 249, ...
"""

import ctypes
import json
import sys

from transfer.transports import TransportSettings, create


def main() -> None:
    size = int(sys.argv[1])
    pattern = bytes(i % 251 for i in range(size))
    regions = [ctypes.create_string_buffer(pattern, size), ctypes.create_string_buffer(pattern[::-1], size)]
    [transport] = create(["cma"], TransportSettings())
    exposure = transport.expose([(ctypes.addressof(r), size) for r in regions])
    offer = exposure.offer()
    print(json.dumps({"kind": offer.kind, "host": offer.host, "blob": offer.blob.hex()}), flush=True)
    for line in sys.stdin:
        if line.strip() == "dump":
            print(json.dumps({"hex": b"".join(r.raw for r in regions).hex()}), flush=True)
        else:
            break
    exposure.close()


if __name__ == "__main__":
    main()
