"""tools/bench-compare against a stand-in refit-bench: which rows it flags, its exit status, and
what --record writes. The stand-in writes the JSON refit-bench writes, its ratio per row read
from FAKE_RATIOS (engine=ratio,...)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "bench-compare"

FAKE_BENCH = textwrap.dedent(
    """\
    #!%s
    import json, os, sys
    args = sys.argv[1:]
    out = args[args.index("--json") + 1]
    ratios = dict(kv.split("=") for kv in os.environ["FAKE_RATIOS"].split(","))
    wrong = int(os.environ.get("FAKE_WRONG", "0"))
    rows = [{"transport": "host_shm", "model": "m", "engine": e, "buffer_mb": 64.0, "layout": "plain",
             "ratio": float(r), "time_ms": {"median": 10.0 / float(r)}, "wrong": wrong}
            for e, r in ratios.items()]
    json.dump({"preamble": {"gpus": [], "cpu": "test cpu"}, "rows": rows}, open(out, "w"))
    """
    % sys.executable
)


def baseline(tmp_path: Path, rows: dict[str, float]) -> Path:
    b = {"tolerance": 0.05, "runs": [{"name": "fake", "needs": {"gpus": 0}, "args": ["--model", "m"],
                                      "rows": [{"key": {"transport": "host_shm", "model": "m", "engine": e,
                                                        "buffer_mb": 64.0, "layout": "plain"},
                                                "ratio": r, "recorded": "then"} for e, r in rows.items()]},
                                     {"name": "needs-gpus", "needs": {"gpus": 64}, "args": [], "rows": []}]}
    p = tmp_path / "baseline.json"
    p.write_text(json.dumps(b))
    return p


def run(tmp_path: Path, base: Path, ratios: str, *extra: str, wrong: int = 0) -> subprocess.CompletedProcess:
    bench = tmp_path / "refit-bench"
    bench.write_text(FAKE_BENCH)
    bench.chmod(0o755)
    env = dict(os.environ, FAKE_RATIOS=ratios, FAKE_WRONG=str(wrong), PATH="/usr/bin:/bin")
    return subprocess.run([sys.executable, str(TOOL), "--bench", str(bench), "--baseline", str(base),
                           "--out", str(tmp_path / "out"), *extra],
                          capture_output=True, text=True, env=env, timeout=60, check=False)


def test_rows_within_tolerance_pass_and_runs_needing_gpus_are_skipped(tmp_path):
    r = run(tmp_path, baseline(tmp_path, {"a": 0.80, "b": 0.50}), "a=0.77,b=0.60")  # -3.75%, +20%
    assert r.returncode == 0, r.stdout + r.stderr
    assert "# 2 rows within 5% of the baseline" in r.stdout
    assert "# skipped: needs-gpus (needs 64 GPUs)" in r.stdout


def test_a_row_more_than_the_tolerance_below_is_flagged(tmp_path):
    r = run(tmp_path, baseline(tmp_path, {"a": 0.80, "b": 0.50}), "a=0.75,b=0.50")  # a: -6.25%
    assert r.returncode == 1
    assert "# 1 of 2 rows flagged:" in r.stdout
    assert "engine=a buffer_mb=64.0 layout=plain: ratio 0.750, recorded 0.800 (then): REGRESSED" in r.stdout
    assert "engine=b" in r.stdout and "engine=b buffer_mb=64.0 layout=plain: ratio" not in r.stdout


def test_missing_rows_and_wrong_values_are_flagged(tmp_path):
    r = run(tmp_path, baseline(tmp_path, {"a": 0.80, "gone": 0.5}), "a=0.90")
    assert r.returncode == 1
    assert "engine=gone buffer_mb=64.0 layout=plain: missing from the run" in r.stdout
    r = run(tmp_path, baseline(tmp_path, {"a": 0.80}), "a=0.90", wrong=3)
    assert r.returncode == 1
    assert "WRONG VALUES (3)" in r.stdout


def test_record_writes_the_measured_ratios(tmp_path):
    base = baseline(tmp_path, {"old": 0.1})
    r = run(tmp_path, base, "x=0.91234,y=0.5", "--record", "--only", "fake")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(base.read_text())["runs"][0]["rows"]
    assert [(row["key"]["engine"], row["ratio"]) for row in rows] == [("x", 0.9123), ("y", 0.5)]
    assert rows[0]["recorded"].endswith(" test cpu")


def test_from_reads_the_runs_an_earlier_out_kept_and_records_them_with_their_date(tmp_path):
    base = baseline(tmp_path, {"x": 0.80})
    kept = tmp_path / "kept"
    kept.mkdir()
    rows = [{"transport": "host_shm", "model": "m", "engine": "x", "buffer_mb": 64.0, "layout": "plain",
             "ratio": 0.7, "time_ms": {"median": 14.0}, "wrong": 0}]
    (kept / "fake.json").write_text(json.dumps({"preamble": {"gpus": ["GPU 0: H200", "GPU 1: H200"],
                                                             "date": "2026-01-02 03:04:05 UTC"}, "rows": rows}))
    # No refit-bench at all: nothing runs. A run without a kept file is skipped, whatever GPUs it needs.
    env = dict(os.environ, PATH="/usr/bin:/bin")
    cmd = [sys.executable, str(TOOL), "--bench", str(tmp_path / "none"), "--baseline", str(base), "--from", str(kept)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60, check=False)
    assert r.returncode == 1, r.stdout + r.stderr  # 0.80 -> 0.70: flagged
    assert "engine=x buffer_mb=64.0 layout=plain: ratio 0.700, recorded 0.800" in r.stdout
    assert f"# skipped: needs-gpus (no {kept / 'needs-gpus.json'})" in r.stdout
    r = subprocess.run([*cmd, "--record", "--only", "fake"], capture_output=True, text=True, env=env, timeout=60,
                       check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    (row,) = json.loads(base.read_text())["runs"][0]["rows"]
    assert (row["ratio"], row["recorded"]) == (0.7, "2026-01-02 2 x GPU 0: H200, GPU 1: H200")
    r = subprocess.run([*cmd[:-1], str(tmp_path / "nowhere")], capture_output=True, text=True, env=env, timeout=60,
                       check=False)
    assert r.returncode == 2
    assert "no folder" in r.stderr


def test_a_run_not_recorded_yet_runs_prints_its_ratios_and_flags_only_wrong_values(tmp_path):
    base = baseline(tmp_path, {})  # the run "fake" without rows: added, not recorded on any machine
    r = run(tmp_path, base, "a=0.42")
    assert r.returncode == 0, r.stdout + r.stderr
    line = next(x for x in r.stdout.splitlines() if "engine=a " in x)
    assert line.split()[-3:] == ["0.420", "NOT", "RECORDED"], line
    assert "# not recorded yet (tools/bench-compare --record --only fake on this machine): fake" in r.stdout
    r = run(tmp_path, base, "a=0.42", wrong=2)
    assert r.returncode == 1
    assert "engine=a buffer_mb=64.0 layout=plain: ratio 0.420, not recorded: WRONG VALUES (2)" in r.stdout
    r = run(tmp_path, base, "a=0.42", "--record", "--only", "fake")
    assert r.returncode == 0, r.stdout + r.stderr
    assert [row["ratio"] for row in json.loads(base.read_text())["runs"][0]["rows"]] == [0.42]


def test_bad_use_exits_2(tmp_path):
    r = run(tmp_path, baseline(tmp_path, {"a": 0.8}), "a=0.8", "--only", "nope")
    assert r.returncode == 2
    assert "no run named nope" in r.stderr
