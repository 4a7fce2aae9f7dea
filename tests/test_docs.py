"""The README and every page under docs/ run as pasted, and the docs site builds strictly."""

import json
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks():
    for page in PAGES:
        for number, code in enumerate(BLOCK.findall(page.read_text()), start=1):
            yield pytest.param(code, id=f"{page.relative_to(ROOT)}#{number}")


BLOCKS = list(_blocks())


def test_every_code_block_is_collected():
    fences = sum(page.read_text().count("```python") for page in PAGES)
    assert fences > 0 and len(BLOCKS) == fences, [b.id for b in BLOCKS]


# Every block runs in one fresh interpreter (JAX, Flax and optax are imported once, not once a
# block), each in a namespace of its own with nothing but what it imports itself, in a folder of
# its own, as `python -c` would run it.
_RUNNER = """
import contextlib, io, json, os, sys, time, traceback
blocks, root = json.load(open(sys.argv[1])), sys.argv[2]
results = {}
for number, (name, code) in enumerate(blocks):
    folder = os.path.join(root, str(number))
    os.makedirs(folder)
    os.chdir(folder)
    out, start = io.StringIO(), time.perf_counter()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, name, "exec"), {"__name__": "__main__"})
        results[name] = [True, out.getvalue()[-500:]]
    except BaseException:
        results[name] = [False, traceback.format_exc()[-3000:]]
    results[name].append(time.perf_counter() - start)
json.dump(results, open(os.path.join(root, "results.json"), "w"))
"""


def test_every_code_block_runs_as_pasted(tmp_path):
    blocks = [(b.id, b.values[0]) for b in BLOCKS]
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    runs = tmp_path / "runs"
    runs.mkdir()
    result = subprocess.run(
        [sys.executable, "-c", _RUNNER, str(tmp_path / "blocks.json"), str(runs)],
        cwd=tmp_path, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((runs / "results.json").read_text())
    assert list(results) == [name for name, _ in blocks]
    for name, (_, output, seconds) in results.items():
        print(f"{name} ({seconds:.1f} s): {output.strip()[-200:]}")
    failed = {name: output for name, (ok, output, _) in results.items() if not ok}
    assert not failed, "\n\n".join(f"{name}:\n{trace}" for name, trace in failed.items())


def test_docs_site_builds_strictly(tmp_path):
    if shutil.which("mkdocs") is None and not _has_module("mkdocs"):
        pytest.fail("mkdocs is not installed: `pip install -e '.[test]'` installs it")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "api" / "index.html").exists()
    api = (tmp_path / "api" / "index.html").read_text()
    for name in ("loss_scaling", "value_and_scaled_grad", "DynamicLossScale", "autocast"):
        assert name in api


def _has_module(name):
    import importlib.util

    return importlib.util.find_spec(name) is not None
