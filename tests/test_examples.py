"""Examples and benchmarks run in a fast mode, so they cannot rot."""

import importlib.util
import pathlib

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load(relative: str):
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def strict_dtype_promotion():
    # Examples are user code: they run under JAX's default promotion.
    with jax.numpy_dtype_promotion("standard"):
        yield


def test_quickstart_learns():
    final_loss = load("examples/quickstart.py").main(["--steps", "150"])
    assert final_loss < 0.05


def test_all_finite_benchmark_runs():
    text = load("benchmarks/bench_all_finite.py").main(
        ["--size", "100000", "--leaves", "100", "--rounds", "1"]
    )
    assert "jmp_policy.all_finite" in text and "x |" in text


def test_train_step_benchmark_runs():
    text = load("benchmarks/bench_train_step.py").main(
        ["--batch", "8", "--width", "32", "--rounds", "1", "--repeats", "2"]
    )
    for name in ("plain optax", "jmp recipe", "apply_if_finite", "DynamicScale", "loss_scaling"):
        assert name in text


def test_linen_cnn_example_fast():
    assert load("examples/linen_cnn.py").main(["--steps", "40"]) > 0.5


def test_nnx_transformer_example_fast():
    assert load("examples/nnx_transformer.py").main(["--steps", "60"]) > 0.6


def test_autocast_example_fast():
    assert load("examples/autocast_flax.py").main(["--steps", "60"]) > 0.7


def test_autocast_benchmark_runs():
    text = load("benchmarks/bench_autocast.py").main(
        ["--dim", "16", "--batch", "2", "--rounds", "1", "--repeats", "1"]
    )
    assert "jmp_policy.autocast" in text
