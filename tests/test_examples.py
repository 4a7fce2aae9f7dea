"""Examples and benchmarks run in a fast mode, so they cannot rot."""

import importlib.util
import math
import os
import pathlib
import re
import shutil
import sys

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from models import dot_operand_types

import jmp_policy as jmp

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load(relative: str):
    path = ROOT / relative
    name = f"_example_{path.parent.name}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
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


@pytest.mark.slow  # two 100-step trainings (15 s); tests/test_fp8.py trains float8 quickly
def test_linen_cnn_example_float8_against_bfloat16(tmp_path):
    policies = "mixed_bfloat16,mixed_float8"
    results = load("examples/linen_cnn.py").main(
        ["--steps", "100", "--policies", policies, "--out", str(tmp_path)]
    )
    assert (tmp_path / "cnn_loss_curves.png").read_bytes()[:4] == b"\x89PNG"
    final = {r.policy: r.final_loss for r in results}
    print(final)  # measured: 0.1539, 0.1544
    assert all(r.accuracy > 0.9 for r in results)
    # float8 matmuls (the hidden Dense) end within 2% of bfloat16's loss.
    assert abs(final["mixed_float8"] / final["mixed_bfloat16"] - 1) < 0.02
    assert results[1].fp8_share > 0 and results[0].fp8_share == 0


def test_nnx_transformer_example_fast():
    assert load("examples/nnx_transformer.py").main(["--steps", "60"]) > 0.6


def test_equinox_example_fast(capsys):
    pytest.importorskip("equinox")
    results = load("examples/equinox_transformer.py").main(["--steps", "20"])
    final = {r.policy: r for r in results}
    print(capsys.readouterr().out)
    assert final["mixed_float16"].half_matmul_share == 1.0
    assert final["float32"].half_matmul_share == 0.0
    assert final["mixed_float16"].skipped == 0
    assert abs(final["mixed_float16"].final_loss / final["float32"].final_loss - 1) < 0.02


def test_autocast_example_fast():
    assert load("examples/autocast_flax.py").main(["--steps", "60"]) > 0.7


def test_demo_fast(tmp_path, capsys):
    # mixed_bfloat16 is left out for time: mixed_float8 computes in bfloat16 wherever it is
    # not float8 (the head), and test_autocast checks every matmul of a transformer under
    # autocast(mixed_bfloat16) runs in bfloat16.
    policies = ["float32", "mixed_float16", "mixed_float8"]
    runs = load("examples/demo.py").main(
        ["--steps", "6", "--batch", "8", "--length", "32", "--val-batches", "2", "--quiet",
         "--out", str(tmp_path), "--policies", ",".join(policies)]
    )  # fmt: skip
    # --advice (debug_precision's overrides for mixed_float16): its precision_advice is run and
    # checked on this model by test_debugger's test_advice_on_a_transformer_keeps_every_matmul...
    assert [r.policy for r in runs] == policies
    assert runs[0].half_share == 0.0 and runs[1].half_share == 1.0
    # mixed_float8: every matmul but the logits head in float8.
    assert runs[2].fp8_share > 0.9 and runs[2].fp8_share + runs[2].half_share == pytest.approx(1.0)
    for name in ("loss_curves.png", "loss_scale.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_underflow_demo(tmp_path):
    results = load("examples/underflow.py").main(["--out", str(tmp_path)])
    reference = results["float32"]["losses"][-1]
    assert results["float16, no loss scaling"]["underflow"] >= 0.5
    assert results["float16, no loss scaling"]["losses"][-1] > 1.5 * reference  # it did not learn
    scaled = results["float16 + dynamic loss scaling"]["losses"][-1]
    assert abs(scaled - reference) <= 0.03 * reference
    assert (tmp_path / "underflow.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow  # about 40 s on 2 cores: .ci/run runs it after the suite (`-m slow`)
def test_run_all_benchmarks_quick(tmp_path):
    # The whole suite in its fast mode: the all_finite and autocast benchmarks,
    # every model shape and variant of the train step, the compile-time sweep
    # and its PNG. Figures are printed, never asserted as
    # timings (this machine is shared); XLA's buffer sizes are deterministic.
    text = load("benchmarks/run_all.py").main(["--quick", "--out", str(tmp_path / "B.md")])
    assert (tmp_path / "B.md").read_text() == text
    assert "Quick mode: tiny shapes" in text  # its figures are labelled as measuring nothing
    for heading in ("all_finite", "Train step on every model shape", "Compile time against",
                    "autocast vs hand-cast", "Low-precision parameters", "GPU",
                    "Collectives per step"):  # fmt: skip
        assert f"## {heading}" in text
    assert "| jmp_policy.all_finite, pytree |" in text and "| jmp_policy.autocast |" in text
    assert (tmp_path / "compile_vs_leaves.png").read_bytes()[:4] == b"\x89PNG"
    # 4 forced devices, FSDP: kernels gathered in float16, every gradient summed in float32.
    assert "| fsdp | linen | mixed_float16 | float32 | all-gather: f16 x9; all-reduce: f32" in text
    assert (tmp_path / "low_precision.png").read_bytes()[:4] == b"\x89PNG"
    # The quick mode's first table trains the long run's digits MLP (seed 0), 4 steps.
    low = [line.split(" | ") for line in text.splitlines() if "| digits MLP, seed 0 |" in line]
    # Bytes per parameter come from XLA's buffer sizes: deterministic, so asserted.
    by_variant = {row[1]: float(row[2]) for row in low}
    print(f"bytes per parameter: {by_variant}")
    assert by_variant["stochastic rounding"] <= 8 and by_variant["Kahan"] <= 10
    assert by_variant["float32 master"] > 11
    # The long run (digits MLP, two seeds) and its gap-by-step plot.
    assert "Long run: MLP 64-256-256-10 on scikit-learn's digits" in text
    assert (tmp_path / "low_precision_long.png").read_bytes()[:4] == b"\x89PNG"
    long_rows = [line.split(" | ") for line in text.splitlines() if line.count(" | ") == 6]
    long_bytes = {row[0].lstrip("| "): float(row[1]) for row in long_rows if row[1][0].isdigit()}
    assert long_bytes["stochastic rounding"] <= 8 and long_bytes["Kahan"] <= 10
    rows = [line.split(" | ") for line in text.splitlines() if line.count(" | ") == 10]
    shapes_seen = {row[0].lstrip("| ") for row in rows} - {"shape"}
    assert shapes_seen == {
        "MLP (4 layers)", "GPT 1 layers (loop)", "GPT 1 layers (nn.scan)", "CNN + BatchNorm",
        "NNX GPT 1 layers",
    }  # fmt: skip
    variants = {row[2] for row in rows} - {"variant"}
    assert variants == {
        "plain optax", "plain optax, again (noise)", "optax.apply_if_finite",
        "flax DynamicScale", "jmp recipe", "hand-written cond", "jmp_policy.loss_scaling",
        "skip on the loss alone (floor)",
    }  # fmt: skip
    # The A/A copy is the baseline's program compiled again: the same buffers,
    # so temp memory is exactly 1.00x; its time ratios are this run's noise.
    for row in rows:
        if row[2] == "plain optax, again (noise)":
            print(f"{row[0].lstrip('| ')} A/A: compile {row[4]}, XLA {row[6]}, step {row[8]}")
            assert row[10].rstrip(" |") == "1.00x" and float(row[3]) > 0
    ours = {row[0].lstrip("| "): row for row in rows if row[2] == "jmp_policy.loss_scaling"}
    for shape, row in ours.items():
        temp = row[10].rstrip(" |")
        print(f"{shape}: compile {row[4]}, XLA {row[6]}, step {row[8]}, temp {temp}")
        # XLA's compile is part of the whole compile (trace, lower, XLA).
        assert 0 < float(row[5]) < float(row[3]) and float(row[7]) > 0


def _largest_change(new, old) -> float:
    return max(jax.tree.leaves(jax.tree.map(lambda a, b: float(abs(a - b).max()), new, old)))


@pytest.mark.slow  # a benchmark's run: .ci/run's slow lane
def test_first_trace_benchmark_of_the_train_step_prints_a_ratio_per_route():
    text = load("benchmarks/bench_first_call.py").main(
        ["--step", "--linen-blocks", "1", "--nnx-blocks", "1", "--repeats", "1"]
    )
    rows = [line.split("|")[1:-1] for line in text.splitlines()[2:]]
    assert [r[0].strip() for r in rows] == ["Linen GPT, 1 blocks", "NNX GPT, 1 blocks"]
    for row in rows:  # the own recipe's time, then the policy's and autocast's ratios to it
        assert float(row[1].split()[0]) > 0
        assert all(float(cell.strip().rstrip("x")) > 0 for cell in row[2:])


@pytest.mark.slow  # a benchmark's run: .ci/run's slow lane
def test_benchmark_floor_is_loss_scaling_without_the_check():
    # The floor row claims to be loss_scaling's step minus the gradient check:
    # on a finite step both must compute the same parameters, bit for bit.
    bench = load("benchmarks/bench_train_step.py")
    shape = bench.shapes.by_name("gpt", quick=True)
    steps = bench.variants(optax.adam(1e-3), shape.loss)
    new = {}
    for name in (bench.FLOOR, "jmp_policy.loss_scaling"):
        init, step = steps[name]
        params = bench._fresh(shape.params)
        args = (params, init(params), bench._fresh(shape.extra), shape.batch)
        new[name] = jax.jit(step)(*args)[0]
    chex.assert_trees_all_equal(new[bench.FLOOR], new["jmp_policy.loss_scaling"])
    moved = _largest_change(new[bench.FLOOR], shape.params)
    print(f"{shape.name}: largest parameter change {moved:.2e}, equal in both")
    assert moved > 0


@pytest.mark.slow  # a benchmark's run: .ci/run's slow lane
def test_compile_instruction_count_compiles_each_variant_and_reads_its_dumps(tmp_path, capsys):
    # Without valgrind the child only compiles (the warm-up first); the parent
    # keeps the dumps the child triggered and none other (callgrind's final one).
    bench = load("benchmarks/bench_compile_instructions.py")
    bench.child("mlp", True, ["jmp_policy.loss_scaling", "plain optax"])
    assert capsys.readouterr().out.splitlines() == [
        "0 plain optax", "1 plain optax", "2 jmp_policy.loss_scaling"
    ]  # fmt: skip
    triggers = ["dump compile0", "dump compile1", "dump compile2", "Program termination"]
    for n, (trigger, count) in enumerate(zip(triggers, (900, 1000, 1300, 5000), strict=True), 1):
        header = f"version: 1\ncmd: python\ndesc: Trigger: {trigger}\nevents: Ir\n"
        (tmp_path / f"callgrind.out.{n}").write_text(header + f"summary: {count}\n")
    assert bench.read_dumps(str(tmp_path / "callgrind.out")) == {0: 900, 1: 1000, 2: 1300}
    text = bench.table({"mlp": {"plain optax": 1000, "jmp_policy.loss_scaling": 1300}})
    assert "| mlp | jmp_policy.loss_scaling | 0.00 | 1.300x |  |" in text.splitlines()
    floor = "skip on the loss alone (floor)"
    text = bench.table({"mlp": {"plain optax": 1000, floor: 1200, "jmp_policy.loss_scaling": 1300}})
    assert "| mlp | jmp_policy.loss_scaling | 0.00 | 1.300x | 1.083x |" in text.splitlines()


def test_compile_instruction_count_rejects_unknown_names():
    bench = load("benchmarks/bench_compile_instructions.py")
    with pytest.raises(ValueError, match="Unknown --shapes 'mlp,resnet'; expected names among"):
        bench.main(["--shapes", "mlp,resnet"])
    with pytest.raises(ValueError, match="Unknown --variants 'adam'; expected names among"):
        bench.main(["--variants", "adam"])


def _git_checkout() -> bool:
    return shutil.which("git") is not None and (ROOT / ".git").exists()


@pytest.mark.slow  # a benchmark's run: .ci/run's slow lane
@pytest.mark.skipif(not _git_checkout(), reason="needs git and a git checkout of the project")
def test_benchmark_against_a_revision_measures_both_loss_scalings():
    # The revision is loaded as a package of its own: its loss_scaling runs,
    # applies a finite step, skips an overflowing one, and the table has both.
    bench = load("benchmarks/bench_against_revision.py")
    old = bench.load_revision("HEAD")
    assert old.__name__.startswith("jmp_policy_at_") and old.loss_scaling is not jmp.loss_scaling
    old_scaling = importlib.import_module(f"{old.__name__}.scaling")
    assert old_scaling.LossScalingState is not jmp.scaling.LossScalingState
    shape = bench.shapes.by_name("mlp_float32", quick=True)
    init, step = bench.bench.loss_scaling_variant(old, optax.adam(1e-3), shape.loss)
    state = init(shape.params)
    moved, state, _ = jax.jit(step)(shape.params, state, {}, shape.batch)
    x, y = shape.batch
    overflow = (x.at[0, 0].set(jnp.inf), y)
    kept, state, _ = jax.jit(step)(moved, state, {}, overflow)
    change = _largest_change(moved, shape.params)
    print(f"{old.__name__}: finite step moved parameters by up to {change:.2e}; overflow skipped")
    assert change > 0 and int(state.skipped_steps) == 1
    chex.assert_trees_all_equal(kept, moved)
    text, _ = bench.main(["HEAD", "--quick", "--shapes", "mlp_float32"])
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| MLP")]
    label = old.__name__.removeprefix("jmp_policy_at_")
    assert [row[2] for row in rows] == [
        "plain optax", "plain optax, again (noise)", f"loss_scaling at {label}",
        "loss_scaling, working tree",
    ]  # fmt: skip
    assert rows[1][10] == "1.00x |"  # the A/A copy's temp memory


@pytest.mark.skipif(not _git_checkout(), reason="needs git and a git checkout of the project")
def test_benchmark_against_a_revision_rejects_an_unknown_revision():
    bench = load("benchmarks/bench_against_revision.py")
    with pytest.raises(ValueError, match="git revision .* for `rev`, got 'no-such-revision'"):
        bench.load_revision("no-such-revision")


@pytest.mark.slow  # a benchmark's smoke run (16 s): .ci/run's slow lane, with the others
def test_gpu_benchmark_configurations_run_tiny_on_cpu():
    # Every configuration's code path, float8 included, at a tiny size; on CPU
    # there is no cuBLASLt, so no fp8 GEMM, and the table says it fell back.
    results = load("benchmarks/gpu_transformer.py").main(["--cpu-smoke"])
    assert [r["config"] for r in results] == [
        "float32", "mixed_bfloat16", "mixed_float16", "mixed_float8", "mixed_mxfp8", "mixed_nvfp4"
    ]  # fmt: skip
    assert all(r["tokens_per_s"] > 0 and r["skipped"] == 0 for r in results)
    assert [r["fp8_gemms"] for r in results] == [0] * 6
    # The emulation on CPU: no call to JAX's op asked for, none compiled.
    assert [(r["block_gemms"], r["block_gemms_requested"]) for r in results] == [(0, 0)] * 6
    assert not any(r["block_hardware"] for r in results)
    # The traced step asks for float8 (or a block-scaled format) on every Dense layer (the head
    # left out): float8 and MXFP8 in both directions; NVFP4's gradient matmuls in float32
    # (its forward third counts).
    print([round(r["fp8_share"], 3) for r in results])
    assert [r["fp8_share"] > 0.5 for r in results] == [False, False, False, True, True, False]
    assert [r["fp8_share"] > 0.2 for r in results] == [False, False, False, True, True, True]


def test_gpu_benchmark_counts_block_gemms_in_both_forms_xla_prints():
    """The compiled-HLO counter, on the two forms XLA's block-scaling rewriter gives a GEMM
    cuDNN takes (a custom call; a cuDNN fusion of the composite), and the fallback it gives
    one cuDNN does not take (a plain dot), which must not count."""
    count = load("benchmarks/gpu_transformer.py").block_scaled_gemms
    cudnn_call = (
        "%cc = (f32[1,128,128]{2,1,0}, u8[0]{0}) custom-call(%a, %b, %sa, %sb), "
        'custom_call_target="__cudnn$blockScaledDot"'
    )
    cudnn_fusion = (
        "%fusion.2 = f32[1,128,128]{2,1,0} fusion(%a, %b, %sa, %sb), kind=kCustom, "
        'calls=%bsd, frontend_attributes={composite.name="mx.block_scaled_dot",'
        'composite.version="1"}, backend_config={"fusion_backend_config":'
        '{"kind":"__cudnn$fusion"}}'
    )
    fallback = (
        "%dot.3 = f32[1,128,128]{2,1,0} dot(%deq.1, %deq.2), lhs_batch_dims={0}, "
        "lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={2}"
    )
    assert count("\n".join([cudnn_call, cudnn_fusion, fallback, cudnn_fusion])) == 3
    assert count(fallback) == 0


def test_gpu_benchmark_exits_cleanly_without_gpu(capsys):
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is present")
    assert load("benchmarks/gpu_transformer.py").main([]) is None
    assert "No GPU here" in capsys.readouterr().out


@pytest.mark.slow  # 30 s of compiling on 2 cores; tests/test_nvfp4_policy.py trains it fast
def test_demo_trains_with_nvfp4s_recipe(tmp_path):
    """`--policies mixed_nvfp4 --fp8-scaling recipe`: each linear layer's three GEMMs in NVFP4
    (`jmp_policy.nvfp4.Recipe`, its keys as state), and the loss goes down
    (benchmarks/bench_nvfp4_recipe.py measures the 300-step runs)."""
    (run,) = load("examples/demo.py").main(
        ["--steps", "4", "--batch", "8", "--length", "32", "--val-batches", "1", "--quiet",
         "--out", str(tmp_path), "--policies", "mixed_nvfp4", "--fp8-scaling", "recipe"]
    )  # fmt: skip
    # Forward and both gradient GEMMs of the 12 linear layers (not attention's products, the
    # head or the embedding): more than a third of the step's matmul FLOPs.
    assert 0.35 < run.fp8_share < 1.0
    assert run.losses[-1] < run.losses[0] and math.isfinite(run.val_loss)


@pytest.mark.slow  # four short demo runs (about 90 s on 2 cores): .ci/run's slow lane
def test_demo_with_delayed_fp8_scaling_ends_within_1_percent_of_current_scaling(tmp_path):
    """The demo's character LM under `mixed_float8` through autocast, its matmuls scaled
    currently and with delayed scaling (a state per matmul, written by `loss_scaling`), two
    seeds: the validation losses within 1% (docs/fp8.md quotes the 300-step runs)."""
    demo = load("examples/demo.py")
    for seed in ("0", "1"):
        val = {}
        for scaling in ("tensorwise", "delayed"):
            (run,) = demo.main(
                ["--steps", "120", "--val-batches", "10", "--quiet", "--out", str(tmp_path),
                 "--policies", "mixed_float8", "--fp8-scaling", scaling, "--seed", seed]
            )  # fmt: skip
            assert run.fp8_share > 0.9
            val[scaling] = run.val_loss
        assert abs(val["delayed"] / val["tensorwise"] - 1) < 0.01, (seed, val)


@pytest.mark.slow
def test_readme_quotes_the_demos_own_figures(tmp_path):
    """README's accuracy table quotes the demo as a user runs it (`python examples/demo.py`:
    300 steps, three policies, XLA's default code generation, not the suite's faster flags,
    which round some sums differently): the validation losses it prints are README's."""
    import subprocess

    readme = (ROOT / "README.md").read_text()
    f16, f32 = re.search(r"validation (\d\.\d{4}) against (\d\.\d{4})", readme).groups()
    bf16_row = r"`mixed_bfloat16` against float32 \| demo: [+-]\S+ \((\d\.\d{4})\)"
    bf16 = re.search(bf16_row, readme)[1]
    env = {
        k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")
    }
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py"), "--quiet", "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    # The summary table: policy, train loss, val loss, ...
    printed = dict(re.findall(r"^(\S+)\s+\d\.\d{4}\s+(\d\.\d{4})\s", out.stdout, re.M))
    assert set(printed) == {"float32", "mixed_float16", "mixed_bfloat16"}, out.stdout[-2000:]
    # Within 2e-4: a last digit XLA may round differently on another CPU, not a drift.
    quoted = {"float32": f32, "mixed_float16": f16, "mixed_bfloat16": bf16}
    for policy, value in printed.items():
        assert abs(float(value) - float(quoted[policy])) <= 2e-4, (policy, value, quoted)


def test_the_demos_bfloat16_step_lowered_for_a_gpu_runs_its_matmuls_in_bfloat16():
    """The demo's bfloat16 row has float32 matmuls on this CPU (its table says why: XLA:CPU
    has no bfloat16 x bfloat16 -> float32 dot). The same gradient step, lowered for a GPU
    (`jax.export`, no GPU needed), runs every matmul on bfloat16 operands."""
    demo = load("examples/demo.py")
    model = jmp.linen.mixed_precision(
        demo.LanguageModel(64, length=32), "mixed_bfloat16", jmp.linen.NORMS_IN_FLOAT32
    )
    x = jnp.zeros((4, 32), jnp.int32)
    params = model.init(jax.random.key(0), x)["params"]

    def loss_fn(params, x, y):
        logits = model.apply({"params": params}, x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    on_cpu, on_gpu = (
        dot_operand_types(jax.grad(loss_fn), params, x, x, platform=p) for p in ("cpu", "cuda")
    )
    assert ("f32", "f32") in on_cpu, on_cpu  # widened here
    assert len(on_gpu) == len(on_cpu) and set(on_gpu) == {("bf16", "bf16")}, on_gpu
