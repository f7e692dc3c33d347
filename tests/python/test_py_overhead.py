"""tools/py-overhead, as README.md tells a user to run it, on a few hundred tiny tensors: it runs
its Python rows through refit.bench (whose rows it builds its arguments for), adds the C++ rows
with --refit-bench, and reports every refit verified. Guards the tool against changes of
refit.bench's arguments, which once left it failing on its first row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import refit

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "py-overhead"
BENCH = Path(refit.__file__).resolve().parents[3] / "bench" / "refit-bench"


@pytest.mark.parametrize("cpp", [True, False], ids=["with-refit-bench", "python-only"])
def test_py_overhead_reports_every_row_verified(tmp_path, cpp):
    if cpp and not BENCH.is_file():
        pytest.skip(f"no refit-bench beside the package ({BENCH}): -Dbench=false")
    out = tmp_path / "figures.json"
    cmd = [sys.executable, str(TOOL), "--tensors", "300", "--iters", "3", "--warmup", "1", "--rounds", "1",
           "--json", str(out)]
    if cpp:
        cmd += ["--refit-bench", str(BENCH)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "# Wrong values: 0 OK" in r.stdout
    fig = json.loads(out.read_text())
    assert fig["tensors"] == 300 and fig["wrong"] == 0
    assert fig["py_ms"] > 0 and fig["source_ms"] >= 0 and fig["one_ms"] > 0
    assert (fig["cpp_ms"] is not None) is cpp
    assert ("c++ refit-bench" in r.stdout) is cpp
