"""Tests for the package itself (jmp_policy/__init__.py, _flax/serialization.py): a lean import
whatever the import order, its public names, its families and the paths of earlier releases."""

import subprocess
import sys

import pytest

import jmp_policy as jmp


def run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip()


def test_import_does_not_load_flax_until_linen_or_nnx_is_used():
    out = run(
        "import sys, jmp_policy as jmp\n"
        "print('flax' in sys.modules)\n"
        "import jax.numpy as jnp, optax\n"
        "tx = jmp.loss_scaling(optax.adam(1e-3), jmp.DynamicLossScale(2.0**15))\n"
        "state = tx.init({'w': jnp.ones(2)})\n"
        "jmp.get_loss_scale(state), jmp.loss_scaling_report(state)\n"
        "print('flax' in sys.modules)\n"
        "print(jmp.linen.mixed_precision.__module__, 'flax' in sys.modules)\n"
    )
    assert out.splitlines() == ["False", "False", "jmp_policy.linen True"]


SERIALIZE = (
    "import jax.numpy as jnp, optax\n"
    "scale = jmp.DynamicLossScale(jnp.float32(8.0), counter=jnp.int32(3))\n"
    "restored = flax.serialization.from_bytes(jmp.DynamicLossScale(1.0), "
    "flax.serialization.to_bytes(scale))\n"
    "print(float(restored.loss_scale), int(restored.counter))\n"
)


def test_flax_serialization_registered_whichever_is_imported_first():
    first = run("import jmp_policy as jmp\nimport flax.serialization\n" + SERIALIZE)
    second = run("import flax.serialization\nimport jmp_policy as jmp\n" + SERIALIZE)
    assert first == second == "8.0 3"


JMP_NAMES = {
    "Policy", "get_policy", "cast_to_full", "cast_to_half", "half_dtype", "LossScale",
    "NoOpLossScale", "StaticLossScale", "DynamicLossScale", "all_finite", "select_tree",
}  # fmt: skip


def test_public_names():
    assert list(jmp.__all__) == sorted(jmp.__all__)
    assert all(hasattr(jmp, name) for name in jmp.__all__)
    # jmp's eleven, and ten for a train step and its reports (issue 61: about twenty).
    assert JMP_NAMES <= set(jmp.__all__) and len(jmp.__all__) <= 22
    assert {"linen", "nnx", "eqx", "scaling", "casting", "reports", "errors"} <= set(dir(jmp))
    # One name per concept: the merged and the internal names are gone.
    for gone in ("precision_census", "Census", "nonfinite_paths", "leaf_finite_vector"):
        assert not hasattr(jmp, gone), gone


def test_no_import_circle_between_the_library_modules():
    # Each module depends only on the layers above it (shared/DESIGN.md): no module may reach
    # itself through imports, at module level or inside a function, across the family
    # packages too (`_core`, `_loss_scaling`, `_autocast`, ...). The package's __init__ (which
    # re-exports the top level) is left out; a package's own __init__ is a node of its own.
    import ast
    import pathlib

    package = pathlib.Path(jmp.__file__).parent
    modules = {
        ".".join(path.relative_to(package).with_suffix("").parts).removesuffix(".__init__")
        for path in package.rglob("*.py")
    }

    def target(module: str, name: str | None = None) -> str | None:
        if not module.startswith("jmp_policy."):
            return None
        inner = module.removeprefix("jmp_policy.")
        return f"{inner}.{name}" if name and f"{inner}.{name}" in modules else inner

    graph = {}
    for path in package.rglob("*.py"):
        name = ".".join(path.relative_to(package).with_suffix("").parts).removesuffix(".__init__")
        if name == "__init__":
            continue
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == "jmp_policy":  # `from jmp_policy import casting`
                    imported |= {a.name for a in node.names if a.name in modules}
                else:
                    imported |= {target(node.module, a.name) for a in node.names} - {None}
            elif isinstance(node, ast.Import):
                imported |= {target(a.name) for a in node.names} - {None}
        graph[name] = imported - {name}
    assert "_loss_scaling.optimizer" in graph and "_core.jaxpr" in graph  # the families are read

    def reaches(start, target, seen):
        for nxt in graph.get(start, ()):
            if nxt == target or (nxt not in seen and reaches(nxt, target, seen | {nxt})):
                return True
        return False

    circles = sorted(m for m in graph if reaches(m, m, {m}))
    assert not circles, {m: sorted(graph[m]) for m in circles}
    assert "low_precision" not in graph["_loss_scaling.optimizer"]  # the circle issue 36 named


def test_every_public_module_says_what_it_exports_and_holds_it():
    """Each public module (`jmp_policy.<name>`, no underscore) has an `__all__` of names it
    holds, none private; a star import gives exactly those, not its helpers."""
    import importlib
    import pathlib

    package = pathlib.Path(jmp.__file__).parent
    public = sorted(p.stem for p in package.glob("*.py") if not p.stem.startswith("_"))
    assert len(public) >= 12, public
    for name in public:
        module = importlib.import_module(f"jmp_policy.{name}")
        exported = getattr(module, "__all__", None)
        assert exported, f"jmp_policy.{name} has no __all__"
        assert all(hasattr(module, n) and not n.startswith("_") for n in exported), name
        namespace: dict = {}
        exec(f"from jmp_policy.{name} import *", namespace)
        assert set(namespace) - {"__builtins__"} == set(exported), name


def test_the_api_reference_documents_the_top_level_and_only_it():
    import pathlib
    import re

    api = (pathlib.Path(__file__).parents[1] / "docs" / "api.md").read_text()
    top = set(re.findall(r"^::: jmp_policy\.(\w+)$", api, re.M))
    assert top == set(jmp.__all__), top ^ set(jmp.__all__)
    # Every other entry names a module path that exists.
    for path in re.findall(r"^::: (jmp_policy\.\w+\.[\w.]+)$", api, re.M):
        module, _, name = path.rpartition(".")
        import importlib

        assert hasattr(importlib.import_module(module), name), path


OLD_PATHS = {  # module paths of an earlier layout (never released), now gone
    "transform": "find_loss_scaling_state",
    "census": "iter_equations",
    "loss_scale": "DynamicLossScale",
    "finite": "all_finite",
    "scaled_grad": "value_and_scaled_grad",
    "diagnostics": "check_loss_scaling",
    "activations": "meet",
    "overrides": "FULL_PRECISION_REGION",
    "debugger": "LayerStats",
}
OLD_TOP_LEVEL = ("AUTOCAST_ALLOW", "LossScalingState", "SkipSpikes", "PrecisionWarning")


def test_the_old_module_paths_and_top_level_names_are_gone():
    """`ls jmp_policy` shows the families (`_core`, `_loss_scaling`, `_autocast`, `_flax`,
    `_fp8`, `_reports`) beside the public modules; the earlier layout's paths and top-level
    names were never released, so they are gone rather than kept with a warning."""
    import importlib
    import pathlib

    package = pathlib.Path(jmp.__file__).parent
    families = {p.name for p in package.iterdir() if p.is_dir() and p.name.startswith("_")}
    assert {
        "_core",
        "_loss_scaling",
        "_autocast",
        "_flax",
        "_fp8",
        "_low_precision",
        "_reports",
    } <= families
    for old in OLD_PATHS:
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"jmp_policy.{old}")
    for name in OLD_TOP_LEVEL:
        with pytest.raises(AttributeError):
            getattr(jmp, name)
    assert jmp.scaling.LossScalingState is not None and jmp.casting.ALLOW is not None


def test_the_library_imports_no_deprecated_path_of_its_own():
    """Every module of the package but the old paths, imported in a fresh interpreter
    (Flax and Equinox included): no DeprecationWarning that names jmp_policy."""
    out = run(
        "import warnings, importlib, pathlib\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import jmp_policy\n"
        "    root = pathlib.Path(jmp_policy.__file__).parent\n"
        "    files = [p.relative_to(root.parent).with_suffix('') for p in root.rglob('*.py')]\n"
        "    names = ['.'.join(f.parts[:-1] if f.name == '__init__' else f.parts) for f in files]\n"
        f"    old = {sorted('jmp_policy.' + p for p in OLD_PATHS)!r}\n"
        "    kept = [n for n in names if not any(n == o or n.startswith(o + '.') for o in old)]\n"
        "    for name in kept:\n"
        "        importlib.import_module(name)\n"
        "said = [str(w.message) for w in caught\n"
        "        if w.category is DeprecationWarning and 'jmp_policy' in str(w.message)]\n"
        "print(len(kept), said)\n"
    )
    count, said = out.split(" ", 1)
    assert int(count) > 40 and said == "[]", out
