"""GPU benchmark: a GPT-style transformer train step in float32, bfloat16, float16, float8,
MXFP8 and NVFP4.

12 layers, d=768, 12 heads, sequence 1024 (GPT-2 small's shape), AdamW. Six
configurations, each in its own process so peak memory is its own:

- float32;
- mixed_bfloat16 (float32 master weights, bfloat16 compute, float32 norms);
- mixed_float16 + dynamic loss scaling (`jmp_policy.loss_scaling`);
- mixed_float8: `linen.mixed_precision(..., "mixed_float8")` (the Dense
  layers' matmuls in float8 with current tensorwise scaling, the logits head
  and everything else in bfloat16);
- mixed_mxfp8 and mixed_nvfp4: the same Dense layers in those block-scaled formats
  (`jax.nn.scaled_dot_general` on a Blackwell GPU, through `jmp_policy.block_scaled`; on
  an older GPU the emulation, whose numbers are the same, so its speed is not the format's).

Reports tokens/s, peak device memory (`memory_stats()`), the speedup over
float32, how many fp8 GEMMs (cuBLASLt float8 custom calls) and how many
block-scaled GEMMs the compiled step holds (cuDNN's, out of the calls to JAX's op the
program asked for), so a silent fallback to bfloat16 is caught. Exits with a message
on machines without a GPU (`--cpu-smoke` runs every configuration at a tiny
size on CPU instead, for the test suite).

    python benchmarks/gpu_transformer.py [--batch 8] [--steps 20] [--layers 12]
"""

import argparse
import functools
import json
import re
import subprocess
import sys
import time

CONFIGS = (
    "float32",
    "mixed_bfloat16",
    "mixed_float16",
    "mixed_float8",
    "mixed_mxfp8",
    "mixed_nvfp4",
)
BLOCK_SCALED = ("mixed_mxfp8", "mixed_nvfp4")


def fp8_gemms(hlo: str) -> int:
    """How many GEMMs with float8 operands an optimized HLO module calls.

    cuBLASLt's matmul custom calls (`__cublas$lt$matmul$f8`) and Triton GEMM
    fusions, on a line that names a float8 type.
    """
    gemm = re.compile(r"__cublas\$lt\$matmul|__triton_gemm")
    float8 = re.compile(r"f8e4m3fn|f8e5m2")
    return sum(1 for line in hlo.splitlines() if gemm.search(line) and float8.search(line))


def block_scaled_gemms(hlo: str) -> int:
    """How many GEMMs of an optimized GPU HLO module run on block-scaled tensor cores: what
    XLA makes of JAX's block-scaled dot when cuDNN takes it, a custom call to
    `__cudnn$blockScaledDot` (earlier XLA) or a cuDNN fusion (`__cudnn$fusion`) of the
    composite `mx.block_scaled_dot` (later XLA). Where cuDNN does not take it, XLA expands the
    op into a dequantization and a plain dot, and this counts 0. Read off XLA's
    block-scaling rewriter; not yet seen on a Blackwell GPU."""
    cudnn_call = re.compile(r'custom_call_target="__cudnn\$blockScaledDot"')
    return sum(
        1
        for line in hlo.splitlines()
        if cudnn_call.search(line) or ("mx.block_scaled_dot" in line and "__cudnn$fusion" in line)
    )


def requested_block_gemms(stablehlo: str) -> int:
    """How many times a lowered (StableHLO) module runs JAX's block-scaled dot, the custom
    call `__op$block_scaled_dot`: counted through the private functions that hold it, since
    JAX lowers each distinct `_scaled_matmul` once and calls it from every use."""
    bodies: dict[str, list[str]] = {}
    for line in stablehlo.splitlines():
        name = re.match(r"\s*func\.func \w+ @([\w$.]+)", line)
        if name:
            bodies[name.group(1)] = []
        elif bodies:
            bodies[next(reversed(bodies))].append(line)

    @functools.cache
    def calls(function: str) -> int:
        return sum(
            ("custom_call @__op$block_scaled_dot" in line)
            + sum(calls(callee) for callee in re.findall(r"\bcall @([\w$.]+)\(", line))
            for line in bodies.get(function, ())
        )

    return calls("main")


def measure(config, args):
    import flax.linen as nn
    import jax
    import optax

    import jmp_policy as jmp
    from jmp_policy import block_scaled

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, mask):
            h = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(num_heads=args.heads)(h, h, mask=mask)
            h = nn.LayerNorm()(x)
            return x + nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(4 * x.shape[-1])(h)))

    class GPT(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(args.vocab, args.dim)(tokens)
            x = x + self.param("position", nn.initializers.normal(0.02), (args.length, args.dim))
            mask = nn.make_causal_mask(tokens)
            for _ in range(args.layers):
                x = Block()(x, mask)
            return nn.Dense(args.vocab, name="head")(nn.LayerNorm()(x))

    # Under mixed_float8 (MXFP8, NVFP4) the Dense layers multiply in float8 (those formats),
    # the head in bfloat16.
    model = jmp.linen.mixed_precision(GPT(), jmp.get_policy(config))
    apply = model.apply
    tokens = jax.random.randint(jax.random.key(0), (args.batch, args.length + 1), 0, args.vocab)
    x, y = tokens[:, :-1], tokens[:, 1:]
    params = model.init(jax.random.key(1), x)["params"]
    scale = jmp.DynamicLossScale(2.0**15) if config == "mixed_float16" else jmp.NoOpLossScale()
    tx = jmp.loss_scaling(optax.adamw(1e-4), scale)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        s = jmp.get_loss_scale(opt_state)

        def loss_fn(p):
            logits = apply({"params": p}, x)
            return s.scale(optax.softmax_cross_entropy_with_integer_labels(logits, y).mean())

        grads = jax.grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    # The float8 share of matmul FLOPs in the traced step (the program asks for
    # float8); `fp8_gemms` below says whether the compiled one got fp8 GEMMs.
    fp8_share = jmp.precision_report(step, params, opt_state, x, y).fp8_matmul_flop_share
    step = jax.jit(step, donate_argnums=(0, 1))
    lowered = step.lower(params, opt_state, x, y)
    hlo = lowered.compile().as_text()
    params, opt_state = step(params, opt_state, x, y)  # compile
    jax.block_until_ready(params)
    start = time.perf_counter()
    for _ in range(args.steps):
        params, opt_state = step(params, opt_state, x, y)
    jax.block_until_ready(params)
    seconds = (time.perf_counter() - start) / args.steps
    stats = jax.devices()[0].memory_stats() or {}
    skipped = int(jmp.scaling.find_loss_scaling_state(opt_state).skipped_steps)
    return {
        "config": config,
        "tokens_per_s": args.batch * args.length / seconds,
        "step_ms": 1e3 * seconds,
        "peak_gib": stats.get("peak_bytes_in_use", 0) / 2**30,
        "skipped": skipped,
        "device": jax.devices()[0].device_kind,
        "fp8_gemms": fp8_gemms(hlo),
        "block_gemms": block_scaled_gemms(hlo),
        "block_gemms_requested": requested_block_gemms(lowered.as_text()),
        "block_hardware": block_scaled.hardware_path(),
        "fp8_share": fp8_share,
    }


def table(results) -> str:
    base = next(r for r in results if r["config"] == "float32")
    lines = [
        f"GPT-style train step on {base['device']}",
        "",
        "| config | tokens/s | step ms | speedup vs float32 | peak memory GiB | memory vs float32 "
        "| 8-bit matmul FLOPs | fp8 GEMMs | block-scaled GEMMs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        fallback = ""
        if r["config"] == "mixed_float8" and not r["fp8_gemms"]:
            fallback = " (none: fell back)"
        elif r["config"] in BLOCK_SCALED and not r["block_hardware"]:
            fallback = " (emulated: not a GPU with block-scaled tensor cores)"
        elif r["config"] in BLOCK_SCALED and r["block_gemms"] < r["block_gemms_requested"]:
            fallback = f" of {r['block_gemms_requested']} asked (the rest fell back)"
        lines.append(
            f"| {r['config']} | {r['tokens_per_s']:,.0f} | {r['step_ms']:.1f} | "
            f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x | {r['peak_gib']:.2f} | "
            f"{r['peak_gib'] / max(base['peak_gib'], 1e-9):.2f}x | {100 * r['fp8_share']:.0f}% | "
            f"{r['fp8_gemms']} | {r['block_gemms']}{fallback} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--one", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--cpu-smoke", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    import jax

    if args.cpu_smoke:  # every configuration, tiny, in this process: the code paths run
        for name, value in (("batch", 2), ("length", 16), ("dim", 32), ("heads", 2),
                            ("layers", 1), ("vocab", 64), ("steps", 1)):  # fmt: skip
            setattr(args, name, value)
        results = [measure(config, args) for config in CONFIGS]
        text = table(results)
        print(text)
        return results

    if jax.default_backend() != "gpu":
        print(
            f"No GPU here (JAX backend: {jax.default_backend()}): the GPU benchmark needs one. Skipped."
        )
        return None
    if args.one:
        print(json.dumps(measure(args.one, args)))
        return None
    results = []
    passthrough = [a for a in (argv if argv is not None else sys.argv[1:])]
    for config in CONFIGS:
        out = subprocess.run(
            [sys.executable, __file__, *passthrough, "--one", config],
            capture_output=True,
            text=True,
            check=True,
        )
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    text = table(results)
    print(text)
    return text


if __name__ == "__main__":
    main()
