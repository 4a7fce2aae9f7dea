"""The README and every page under docs/ run as pasted, and the docs site builds strictly."""

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


@pytest.mark.standard_promotion  # user code runs under JAX's default promotion
@pytest.mark.parametrize("code", BLOCKS)
def test_code_block_runs_as_pasted(code, tmp_path):
    # A fresh interpreter: nothing but what the block imports itself.
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    print(result.stdout[-500:])


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
