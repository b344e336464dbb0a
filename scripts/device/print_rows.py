"""bench_tp's rows, one line each, from its --json output (the device scripts' summary).

python3 scripts/device/print_rows.py FILE.json
"""

import json
import sys


def main(path: str) -> int:
    try:
        with open(path) as f:
            rows = json.load(f)["rows"]
    except (OSError, ValueError, KeyError) as exc:
        print(f"no rows in {path}: {exc}")
        return 1
    for r in rows:
        ratio = r.get("x_1to1") if r.get("x_1to1") is not None else r.get("ratio_to_equal_tp")
        cpu = r.get("host_cpu_ms_by_role")
        print(
            f"  {r['tp']:>4} {r['page_size']}:{r['decode_page_size']} {r['ms']:7.2f} ms x1:1 {ratio} "
            f"verified {r['verified']} mode {r['mode']}"
            + (f" | ahead {r['ahead_ms']:7.2f} ms x1:1 {r.get('x_1to1_ahead')}" if "ahead_ms" in r else "")
            + (f" cpu {cpu}" if cpu else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
