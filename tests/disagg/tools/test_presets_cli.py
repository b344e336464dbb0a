import json
import subprocess
import sys

from kvpool.presets import PRESETS


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "disagg", *args], capture_output=True, text=True, timeout=60)


def test_presets_json():
    out = _run("presets", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert set(data) == set(PRESETS)
    gpt = data["gpt-oss-120b"]
    assert gpt["layers"] == 36 and gpt["page_size"] == 16
    assert {"kind": "swa", "num_layers": 18, "bytes_per_token": 36864, "window": 128} == gpt["components"][1]
    ds = {c["kind"]: c for c in data["deepseek-v3.2"]["components"]}
    assert ds["full"]["bytes_per_token"] == 70272 and ds["nsa"]["bytes_per_token"] == 8052
    qwen = {c["kind"]: c for c in data["qwen3-next-80b-a3b"]["components"]}
    assert qwen["mamba"]["bytes_per_request"] == 36 * (49152 + 2097152)
    assert "bytes_per_token" not in qwen["mamba"]


def test_presets_table_shows_per_shard_figures():
    out = _run("presets", "--tp", "4")
    assert out.returncode == 0, out.stderr
    line = next(l for l in out.stdout.splitlines() if l.startswith("llama-3.1-70b"))
    assert "327,680" in line and "81,920" in line


def test_presets_rejects_bad_tp():
    out = _run("presets", "--tp", "0")
    assert out.returncode != 0 and "--tp" in out.stderr
