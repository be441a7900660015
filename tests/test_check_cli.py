"""`shardc check FILE [--world N] [--mesh M] [--json]` through the CLI dispatcher.

Exit codes: 0 valid (warnings on stderr), 1 invalid (rustc-style diagnostics on stderr;
also a missing file), 2 usage (argparse). The dispatcher is limited to the `check`
command so these tests do not depend on the other subcommands' modules.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardc import cli

ROOT = Path(__file__).resolve().parent.parent
EX = ROOT / "examples" / "strategies"


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(cli, "COMMANDS", {"check": cli.COMMANDS["check"]})


def check(capsys, *argv):
    try:
        rc = cli.main(["check", *map(str, argv)])
    except SystemExit as e:           # argparse usage errors
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_valid_file_exits_0(capsys):
    rc, out, err = check(capsys, EX / "paro_iig.shard", "--world", 8)
    assert rc == 0 and err == ""
    assert "ok (paro_iig, mesh node(2) > gpu(4))" in out


def test_json_output(capsys):
    rc, out, err = check(capsys, EX / "zeropp.shard", "--world", 8, "--json")
    assert rc == 0
    data = json.loads(out)
    assert data["name"] == "zeropp"
    assert data["mesh"] == [{"name": "node", "size": 2}, {"name": "gpu", "size": 4}]
    assert data["params"] == {"levels": ["node", "gpu"], "factor": 8,
                              "secondary": {"levels": ["gpu"], "factor": 4, "quant": None},
                              "comm": "int8", "dtype": "fp32"}
    assert data["grads"] == {"levels": ["node", "gpu"], "factor": 8, "comm": "int4", "dtype": "fp32"}
    assert data["optim"] == {"levels": ["node", "gpu"], "factor": 8}
    assert (data["accumulate"], data["prefetch"], data["collectives"]) == (1, 1, "auto")
    assert data["units"] == {"kind": "auto", "names": []}
    assert (data["bucket"], data["overrides"], data["warnings"]) == (None, [], [])


def test_mesh_override(capsys):
    rc, out, _ = check(capsys, EX / "zero_topo.shard", "--world", 8, "--mesh", "node(2) > gpu(2) > gcd(2)", "--json")
    assert rc == 0 and [m["size"] for m in json.loads(out)["mesh"]] == [2, 2, 2]
    rc, _, err = check(capsys, EX / "zero_topo.shard", "--world", 8, "--mesh", "node(2) > gpu(2) > gcd(4)")
    assert rc == 1 and "2 × 2 × 4 = 16 ranks but the world size is 8" in err and "--> <mesh>:1:1" in err


def test_warnings_exit_0_on_stderr(capsys, tmp_path):
    f = tmp_path / "w.shard"
    f.write_text("mesh node(2) > gpu(4)\noptim shard over node\n")
    rc, out, err = check(capsys, f, "--json")
    assert rc == 0 and err.startswith("warning: `optim` shards over `node` but not over `gpu`")
    assert json.loads(out)["warnings"][0].startswith("warning: ")


def test_invalid_file_exits_1_rustc_style(capsys, tmp_path):
    f = tmp_path / "bad.shard"
    f.write_text("mesh node(*) > gpu(local)\nparams shard over world\ngrads  shard over gpu\n"
                 "optim  shard over world\naccumulate 2\n")
    rc, out, err = check(capsys, f, "--world", 8)
    assert rc == 1 and out == ""
    lines = err.splitlines()
    assert lines[0] == ("error: dependency rule: `grads` (line 3) does not shard over `node`, "
                        "which `params` (line 2) shards over")
    assert lines[1] == f" --> {f}:3:8"
    assert lines[2:5] == ["  |", "3 | grads  shard over gpu", "  |        ^^^^^^^^^^^^^^"]
    # the caret starts under column 8 and spans `shard over gpu`
    src, caret = lines[3], lines[4]
    start = caret.index("^")
    assert src[start:start + caret.count("^")] == "shard over gpu"
    assert lines[5] == "  = note: `params` shards over node, gpu here"
    assert lines[7:10] == ["  |", "2 | params shard over world", "  |        ----------------"]
    assert lines[10].startswith("  = help: a rank must hold the gradients")
    assert lines[-1] == f"{f}: 1 error"


def test_several_errors_counted(capsys):
    rc, _, err = check(capsys, ROOT / "tests" / "corpus" / "many_errors.shard", "--world", 8)
    assert rc == 1 and err.count("\nerror: ") + err.startswith("error: ") == 5
    assert err.rstrip().endswith("many_errors.shard: 5 errors")


def test_missing_file_exits_1(capsys, tmp_path):
    rc, _, err = check(capsys, tmp_path / "nope.shard")
    assert rc == 1 and err.strip() == f"error: no such strategy file: {tmp_path / 'nope.shard'}"


@pytest.mark.parametrize("argv", [[], ["x.shard", "--world", "abc"], ["x.shard", "--world", "0"],
                                  ["x.shard", "--bogus"]])
def test_usage_errors_exit_2(capsys, argv):
    rc, _, err = check(capsys, *argv)
    assert rc == 2 and "usage:" in err


def test_star_without_world(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    rc, _, err = check(capsys, EX / "ddp.shard")
    assert rc == 1 and "the world size is unknown" in err and "pass --world N" in err
