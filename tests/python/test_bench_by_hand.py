"""refit-bench run by hand, as README.md's "refit-bench by hand" tells a user: a receiver in one
terminal, the streamer command it prints in another. What the user reads: the command runs as
printed (the bench's own path, since `tools/dev build` puts refit-bench on no PATH), the receiver's
terminal gets one short line per version (not every tensor's checksum), a second run against the
same receiver says to start a fresh one, and a failed run's table does not end in "OK".

Runs the refit-bench of the build tree the package was imported from (<build>/bench/refit-bench).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
from pathlib import Path

import pytest

import refit

from conftest import WAIT

BENCH = Path(refit.__file__).resolve().parents[3] / "bench" / "refit-bench"

ROOT = Path(__file__).resolve().parents[2]
needs_bench = pytest.mark.skipif(not BENCH.is_file(), reason=f"no refit-bench beside the package ({BENCH}): -Dbench=false")


@pytest.fixture
def hand_receiver(tmp_path):
    err = open(tmp_path / "receiver.err", "w+")
    rx = subprocess.Popen([str(BENCH), "--role", "receiver", "--model", "tiny", "--bind", f"ipc://{tmp_path}/x"],
                          stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        ready = json.loads(rx.stdout.readline())
        assert ready["event"] == "ready"
        err.seek(0)
        yield rx, ready, err.read()
    finally:
        rx.send_signal(signal.SIGTERM)
        rx.wait(WAIT)
        err.close()


def streamer_command(banner: str):
    lines = banner.splitlines()
    return shlex.split(lines[lines.index("refit-bench: start the streamer with:") + 1])


def run(cmd):
    return subprocess.run(cmd + ["--warmup", "0", "--iters", "2", "--buffer-mb", "1"], capture_output=True, text=True,
                          timeout=WAIT * 4, check=False)


@needs_bench
def test_the_printed_streamer_command_runs_and_the_receiver_prints_one_short_line_a_version(hand_receiver):
    rx, ready, banner = hand_receiver
    cmd = streamer_command(banner)
    assert cmd[0] == str(BENCH) and os.path.isabs(cmd[0])  # runs from any directory, without PATH
    assert cmd[1:5] == ["--role", "streamer", "--connect", ready["endpoint"]]
    first = run(cmd)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "# Wrong values          : 0 OK\n" in first.stdout
    committed = json.loads(rx.stdout.readline())
    assert committed["event"] == "committed" and committed["version"] == 1
    assert "checksums" not in committed and committed["tensors"] == ready["tensors"]
    assert len(json.dumps(committed)) < 400


@needs_bench
def test_a_second_run_against_the_same_receiver_says_to_start_a_fresh_one_and_its_table_is_not_ok(hand_receiver):
    rx, ready, banner = hand_receiver
    cmd = streamer_command(banner)
    assert run(cmd).returncode == 0
    again = run(cmd)
    assert again.returncode != 0
    assert "is not newer than the committed version" in again.stderr, again.stderr
    assert "start a fresh receiver (refit-bench --role receiver) for each run" in again.stderr
    assert "# Wrong values          : 0 (the run FAILED: its error follows on stderr)" in again.stdout, again.stdout
    assert "0 OK" not in again.stdout


def dev_function(script: str):
    """Runs `script` in bash with tools/dev's functions defined (sourcing it runs `help`)."""
    return subprocess.run(["bash", "-c", f"source {shlex.quote(str(ROOT / 'tools' / 'dev'))} help >/dev/null; {script}"],
                          capture_output=True, text=True, timeout=WAIT, check=False)


def test_tools_dev_bench_configures_quietly_and_shows_meson_only_when_it_fails():
    ok = dev_function('configure() { seq 60; }; quiet_configure build && echo "rc=$?"')
    assert (ok.stdout, ok.stderr) == ("rc=0\n", "")
    failed = dev_function('configure() { echo "ERROR: Dependency libzmq not found"; return 3; }; '
                          'quiet_configure build || echo "rc=$?"')
    assert failed.stdout == "rc=3\n"
    assert failed.stderr == ("ERROR: Dependency libzmq not found\n"
                             "tools/dev: configuring build failed (meson output above)\n")
    assert "quiet_configure build" in (ROOT / "tools" / "dev").read_text()  # what cmd_bench runs
