"""Every ```python block of README.md runs.

tests/readme/readme_blocks.py writes each block (fragments after tests/readme/readme_prelude.py,
whose placeholders run the other side of the refit in a process: tests/readme/readme_peer.py);
each is run in a fresh Python,
then its readme_check() compares both models bit for bit. Without a GPU the blocks' cuda_ipc
becomes host_shm (the prelude's models are then on the CPU); on a GPU machine they run as written. The two-process example (the blocks marked file=engine.py
and file=trainer.py) runs as the README says: engine.py in the background, then trainer.py, with
an endpoint file between them, unchanged on either kind of machine.
"""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
README = os.path.join(ROOT, "README.md")
DRIVER = (
    "import runpy, sys\n"
    "ns = runpy.run_path(sys.argv[1], run_name='__readme__')\n"
    "check = ns.get('readme_check')\n"
    "if check is not None: check()\n"
)


def _cuda():
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def _blocks(tmp):
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "readme", "readme_blocks.py"), "--lang", "python",
         "--prelude", os.path.join(ROOT, "tests", "readme", "readme_prelude.py"), "--out", str(tmp), README],
        capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    return [line for line in out.stdout.splitlines() if line]


def _block_lines():
    """README lines of the Python blocks' opening fences (the test ids), read the way
    readme_blocks.py does, so that a block added to the README gets a test of its own."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "readme"))
    try:
        import readme_blocks
    finally:
        sys.path.pop(0)
    return [g[0].line for g in readme_blocks.group(readme_blocks.parse(README), "python") if g[0].file is None]


LINES = _block_lines()


def test_the_readme_has_python_blocks_for_both_sides():
    assert len(LINES) >= 3, LINES


@pytest.mark.parametrize("line", LINES, ids=[f"README.md:{n}" for n in LINES])
def test_readme_python_block_runs_and_refits(line, tmp_path):
    files = {os.path.basename(f): f for f in _blocks(tmp_path)}
    path = files[f"block_{line}.py"]
    if not _cuda():
        with open(path, encoding="utf-8") as f:
            text = f.read()
        with open(path, "w", encoding="utf-8") as f:
            f.write(text.replace('transport="cuda_ipc"', 'transport="host_shm"'))
    run = subprocess.run([sys.executable, "-c", DRIVER, path], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1", REFIT_README_DIR=os.path.join(ROOT, "tests", "readme")), check=False)
    assert run.returncode == 0, f"README.md:{line} failed:\n{run.stdout}\n{run.stderr}"
    assert "readme_check: ok" in run.stdout, run.stdout


def test_the_readmes_two_process_example_refits_and_both_sides_agree(tmp_path):
    files = {os.path.basename(f): f for f in _blocks(tmp_path / "blocks")}
    assert {"engine.py", "trainer.py"} <= files.keys(), sorted(files)
    endpoint_file = tmp_path / "refit-endpoint"
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    engine = subprocess.Popen([sys.executable, files["engine.py"], str(endpoint_file)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)
    try:
        trainer = subprocess.run([sys.executable, files["trainer.py"], str(endpoint_file)], capture_output=True,
                                 text=True, timeout=240, env=env, check=False)
        engine_out, engine_err = engine.communicate(timeout=60)
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()
    assert trainer.returncode == 0, f"trainer.py failed:\n{trainer.stdout}\n{trainer.stderr}"
    assert engine.returncode == 0, f"engine.py failed:\n{engine_out}\n{engine_err}"
    version_lines = re.compile(r"^version \d+: fingerprint \S+$", re.M)
    trained, served = version_lines.findall(trainer.stdout), version_lines.findall(engine_out)
    assert len(trained) == 3, trainer.stdout
    assert served == trained, f"engine:\n{engine_out}\ntrainer:\n{trainer.stdout}"
    assert "engine: serving on ipc://" in engine_out and "engine: done at version 3" in engine_out
    transport = "cuda_ipc" if _cuda() else "host_shm"
    assert f"trainer: 3 versions over {transport}," in trainer.stdout, trainer.stdout
    assert not endpoint_file.exists()  # the engine removed what it published
