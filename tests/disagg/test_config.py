"""Where flag values come from (disagg/config.py), through the real console script: the
command line over DISAGG_<FLAG> over --config FILE over the built-in default; --print-config;
every flag of every command documents its default and variable; --help imports no torch."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from disagg import config
from disagg.cli import CONFIGURABLE, build_parser
from disagg.config import tomllib

DISAGG = str(Path(sys.executable).with_name("disagg"))


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DISAGG_")}
    return subprocess.run([DISAGG, *args], capture_output=True, text=True, env={**clean, **env}, timeout=60)


def _effective(*args: str, **env: str) -> dict:
    out = _run(*args, "--print-config", **env)
    assert out.returncode == 0, out.stderr
    return tomllib.loads(out.stdout)[args[0]]


def test_command_line_over_environment_over_file_over_default(tmp_path):
    cfg = tmp_path / "disagg.toml"
    cfg.write_text(
        'page-size = 32\nqueue-wait = 2.5\ntransport = "mooncake"\n'
        "[prefill]\nmax-requests = 7\ninsecure = true\n"
        "[decode]\nmax-requests = 9\n"
    )
    prefill = _effective("prefill", "--config", str(cfg), "--page-size", "64", DISAGG_QUEUE_WAIT="4")
    assert prefill["page-size"] == 64  # command line
    assert prefill["queue-wait"] == 4.0  # environment over file
    assert prefill["transport"] == "mooncake"  # file (top level)
    assert prefill["max-requests"] == 7 and prefill["insecure"] is True  # its own table
    assert prefill["dead-after"] == 5.0  # built-in
    assert _effective("decode", "--config", str(cfg))["max-requests"] == 9
    assert _effective("router", "--config", str(cfg), "--pair", "http://a:1,http://b:2,main")["http-port"] == 0


def test_the_printed_config_reads_back_to_the_same_values(tmp_path):
    first = _run(
        "decode",
        "--page-size",
        "16",
        "--bootstrap-addr",
        "main=tcp://10.0.0.5:8998",
        "--pool-bytes",
        "512MiB",
        "--print-config",
    )
    assert first.returncode == 0, first.stderr
    saved = tmp_path / "decode.toml"
    saved.write_text(first.stdout)
    again = _run("decode", "--config", str(saved), "--print-config")
    assert again.returncode == 0, again.stderr
    assert tomllib.loads(again.stdout) == tomllib.loads(first.stdout)
    values = tomllib.loads(first.stdout)["decode"]
    assert values["pool-bytes"] == 512 << 20 and values["bootstrap-addr"] == ["main=tcp://10.0.0.5:8998"]


def test_pairs_and_lists_come_from_the_environment_too():
    router = _effective("router", DISAGG_PAIR="http://a:1,http://b:2,main http://c:3,http://d:4,tcp://e:5")
    assert router["pair"] == ["http://a:1,http://b:2,main", "http://c:3,http://d:4,tcp://e:5"]


def test_flags_that_exclude_each_other_are_settled_by_source(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("max-tokens = 4096\n")
    values = _effective("prefill", "--config", str(cfg), "--pool-bytes", "1GiB")
    assert values["pool-bytes"] == 1 << 30 and "max-tokens" not in values  # the file's choice gave way
    values = _effective("prefill", "--config", str(cfg), DISAGG_POOL_BYTES="2GiB")
    assert values["pool-bytes"] == 2 << 30 and "max-tokens" not in values


@pytest.mark.parametrize(
    "args,env,file,says",
    [
        (["prefill"], {"DISAGG_PAGE_SIZE": "12"}, None, "DISAGG_PAGE_SIZE=12: 12 is not a power of two"),
        (["prefill"], {"DISAGG_TRANSPORT": "carrier-pigeon"}, None, "DISAGG_TRANSPORT=carrier-pigeon: choose from"),
        (["prefill"], {"DISAGG_INSECURE": "maybe"}, None, "DISAGG_INSECURE=maybe: want true or false"),
        (["prefill"], {}, "[prefill]\npage-sise = 16\n", "[prefill] has no flag page-sise"),
        (["prefill"], {}, "page-size = 12\n", "page-size = 12: 12 is not a power of two"),
        (["prefill"], {}, "page-sise = 16\n", "no command has a flag or table page-sise"),
        (["prefill"], {}, "[prefil]\npage-size = 16\n", "no command has a flag or table prefil"),
        (["prefill"], {}, "page-size = [", "not TOML"),
        (["router"], {"DISAGG_PAIR": "A,B,C,D"}, None, "DISAGG_PAIR=A,B,C,D: want PREFILL_URL,DECODE_URL,BOOTSTRAP"),
        (["router"], {"DISAGG_PAIR": "A,B"}, None, "DISAGG_PAIR=A,B: 'A' is not http://HOST:PORT"),
    ],
)
def test_a_bad_value_from_a_variable_or_file_is_one_line_naming_its_source(tmp_path, args, env, file, says):
    if file is not None:
        (tmp_path / "c.toml").write_text(file)
        args = [*args, "--config", str(tmp_path / "c.toml")]
    out = _run(*args, "--print-config", **env)
    assert out.returncode == 2 and says in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_a_missing_config_file_is_named():
    out = _run("bench", "--config", "/nonexistent/disagg.toml", "--router", "http://x:1")
    assert out.returncode == 2 and "--config /nonexistent/disagg.toml: No such file" in out.stderr


def test_every_flag_has_help_with_its_default_and_variable():
    parser = build_parser()
    for name in CONFIGURABLE:
        for action in config.flags(parser.commands[name]):
            text = action.help or ""
            assert len(text) > len(f"[env {config.env_name(action)}]") + 10, (name, action.dest, text)
            assert config.env_name(action) in text, (name, action.dest)
            if not isinstance(action, argparse._StoreTrueAction) and not action.required:
                assert "default" in text, (name, action.dest, text)


def test_one_name_per_thing_across_roles():
    parser = build_parser()
    http = {name: {a.dest for a in config.flags(parser.commands[name])} for name in ("prefill", "decode", "router")}
    assert all({"http_host", "http_port"} <= dests for dests in http.values())
    assert "bootstrap_bind" in {a.dest for a in config.flags(parser.commands["bootstrap"])}
    # the former names still parse, into the one name
    assert parser.parse_args(["router", "--pair", "http://a:1,http://b:2,m", "--port", "8000"]).http_port == 8000
    assert parser.parse_args(["bootstrap", "--bind", "tcp://0.0.0.0:1"]).bootstrap_bind == "tcp://0.0.0.0:1"


def test_pool_bytes_takes_human_units():
    assert _effective("prefill", "--pool-bytes", "8GiB")["pool-bytes"] == 8 << 30
    assert _effective("prefill", "--pool-bytes", "1.5GB")["pool-bytes"] == 1_500_000_000
    out = _run("prefill", "--pool-bytes", "lots")
    assert out.returncode == 2 and "'lots' is not a size (e.g. 8GiB" in out.stderr


@pytest.mark.parametrize("command", ["", *CONFIGURABLE, "presets", "keygen"])
def test_help_imports_no_torch(command):
    code = (
        "import sys\nfrom disagg.cli import main\ntry:\n    main([%r, '--help'] if %r else ['--help'])\n"
        "except SystemExit:\n    pass\nprint([m for m in ('torch', 'transformers', 'mooncake', 'cupy') "
        "if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code % (command, command)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-300:]


def test_a_transports_own_flags_come_from_every_source(tmp_path):
    """Each transport declares its flags (transfer/transports/kind.py); they are read from the
    command line, DISAGG_<FLAG> and --config like any other flag."""
    cfg = tmp_path / "disagg.toml"
    cfg.write_text('rdma-devices = "mlx5_1"\n')
    values = _effective("prefill", "--config", str(cfg), "--cuda-ipc-blocks", "8", DISAGG_MOONCAKE_PROTOCOL="rdma")
    assert (values["mooncake-protocol"], values["rdma-devices"], values["cuda-ipc-blocks"]) == ("rdma", "mlx5_1", 8)
    out = _run("decode", "--cuda-ipc-blocks", "0")
    assert out.returncode == 2 and "--cuda-ipc-blocks: 0 must be at least 1" in out.stderr


def test_every_transport_choice_and_setting_comes_from_the_registry():
    """A kind registered once (the tests' memory transport, harness/memory.py) is a --transport
    choice of the workers and the demo, with its flags, and its settings reach the worker."""
    from harness import memory
    from disagg.worker import flags
    from transfer.transports import TRANSPORTS
    from transfer.transports.mooncake import MooncakeSettings

    memory.register()
    parser = build_parser()
    for command in ("prefill", "decode", "demo"):
        [choices] = [a.choices for a in parser.commands[command]._actions if a.dest == "transport"]
        assert list(choices) == TRANSPORTS.choices() and "memory" in choices, command
    args = parser.parse_args(
        [
            "prefill",
            "--transport",
            "memory",
            "--memory-fail-writes",
            "--device",
            "cpu",
            "--mooncake-protocol",
            "rdma",
            "--insecure",
        ]
    )
    settings = flags.worker_settings(args)
    assert settings["transports"] == ("memory",)
    assert settings["transport_settings"].of(memory.MemorySettings) == memory.MemorySettings(fail_writes=True)
    assert settings["transport_settings"].of(MooncakeSettings).protocol == "rdma"


def test_flags_sit_in_groups_that_say_what_they_are_for():
    groups = {a.dest: g.title for g in build_parser().commands["decode"]._action_groups for a in g._group_actions}
    assert groups["dead_after"] == groups["bootstrap_timeout"] == "deadlines, liveness and admission"
    assert groups["torch_threads"] == groups["log_level"] == "process" and groups["preset"] == "model and pool"
    assert groups["http_port"] == groups["http_host"] != groups["host"] == "transfer"
    assert {d for d, t in groups.items() if t == "fault injection (testing)"} == {"inject_faults", "fault_seed"}


def test_the_prefix_cache_switch_comes_from_every_source_and_is_checked(tmp_path):
    assert _effective("decode")["prefix-cache"] is True  # on by default
    assert _effective("decode", "--no-prefix-cache")["prefix-cache"] is False
    assert _effective("decode", DISAGG_PREFIX_CACHE="0")["prefix-cache"] is False
    path = tmp_path / "c.toml"
    path.write_text("[decode]\nprefix-cache = false\n")
    assert _effective("decode", "--config", str(path))["prefix-cache"] is False
    assert _effective("decode", "--config", str(path), "--prefix-cache")["prefix-cache"] is True
    bad = _run("decode", "--print-config", DISAGG_PREFIX_CACHE="maybe")
    assert bad.returncode != 0 and "DISAGG_PREFIX_CACHE=maybe: want true or false" in bad.stderr


def test_the_staged_chunk_size_reaches_the_transfer_config_and_is_checked():
    from disagg.worker import flags

    parser = build_parser()
    assert flags.transfer_config(parser.parse_args(["prefill", "--insecure"])).staging_chunk_bytes == 0  # a slot's
    args = parser.parse_args(["prefill", "--staging-chunk-kib", "2048", "--insecure"])
    assert flags.transfer_config(args).staging_chunk_bytes == 2 << 20
    bad = _run("prefill", "--staging-chunk-kib", "-1", "--print-config")
    assert bad.returncode != 0 and "-1 must be at least 0" in bad.stderr and "Traceback" not in bad.stderr
