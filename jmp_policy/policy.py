"""Precision policies: which dtype parameters, computation and outputs use.

A `Policy` is a small, frozen, hashable value (usable as a static `jit`
argument). Its `cast_to_*` methods cast the floating leaves of any pytree and
leave everything else (integers, bools, PRNG keys, None, Python objects) alone.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jmp_policy._core.validation import HALF_MASTER_WEIGHTS, warn_once_per_mistake

T = TypeVar("T")

# Short names accepted by jmp's grammar, plus the full NumPy names. "half" is
# resolved per backend by `half_dtype()`, so it is handled separately.
_DTYPE_ALIASES = {
    "full": "float32",
    "f32": "float32",
    "float32": "float32",
    "f16": "float16",
    "float16": "float16",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "f64": "float64",
    "float64": "float64",
    # Block-scaled formats: the compute dtype names the format (`jmp_policy.block_scaled`).
    "mxfp8": "float8_e8m0fnu",
    "nvfp4": "float4_e2m1fn",
}
BLOCK_FORMATS = {"float8_e8m0fnu": "mxfp8", "float4_e2m1fn": "nvfp4"}
"""The compute dtypes that name a block-scaled format (`mixed_mxfp8`, `mixed_nvfp4`)."""
_KEY_ALIASES = {
    "p": "params",
    "params": "params",
    "c": "compute",
    "compute": "compute",
    "o": "output",
    "output": "output",
}
_PRESETS = ("mixed_float16", "mixed_bfloat16", "mixed_float8", "mixed_mxfp8", "mixed_nvfp4")
# mixed_float8: float8 matmuls (e4m3 forward, e5m2 gradients) where `autocast`
# runs the program, bfloat16 for everything else.
_PRESET_COMPUTE = {
    "mixed_float16": "float16",
    "mixed_bfloat16": "bfloat16",
    "mixed_float8": "float8_e4m3fn",
    # mixed_mxfp8 / mixed_nvfp4: block-scaled matmuls (`jmp_policy.block_scaled`), bfloat16 for
    # the rest; the compute dtype names the format (MXFP8's scale type, NVFP4's value type).
    "mixed_mxfp8": "float8_e8m0fnu",
    "mixed_nvfp4": "float4_e2m1fn",
}


def half_dtype() -> np.dtype:
    """Returns the half-precision dtype for the current default backend.

    bfloat16 on TPU (which has no fast float16), float16 elsewhere.

    Examples:
      >>> import jmp_policy as jmp
      >>> jmp.half_dtype()  # on a CPU or GPU
      dtype('float16')
    """
    on_tpu = jax.local_devices()[0].platform == "tpu"
    return np.dtype(jnp.bfloat16 if on_tpu else jnp.float16)


# The floating dtypes JAX computes in (NumPy's float128 is not one), and the 8- and 4-bit
# formats this JAX knows (ml_dtypes), named as NumPy names them.
_JAX_FLOATS = frozenset(
    np.dtype(getattr(jnp, name))
    for name in (
        "float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2",
        "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3b11fnuz", "float8_e4m3",
        "float8_e3m4", "float8_e8m0fnu", "float4_e2m1fn",
    )
    if hasattr(jnp, name)
)  # fmt: skip


# Every dtype NumPy knows by a type (ml_dtypes' formats included, which JAX registers), by the
# name NumPy gives it.
_DTYPES_BY_NAME = {np.dtype(t).name: np.dtype(t) for t in set(np.sctypeDict.values())}


def named_dtype(name: str) -> np.dtype | None:
    """The dtype `name` names as NumPy names it (`dtype.name`: "float32", "bfloat16", "int8"),
    or None. Other strings NumPy parses are not names: structured dtypes (',', 'i4,f8'; some
    raise a SyntaxError), type codes ('d' is float64) and deprecated aliases ('a', which warns)
    are looked up, never parsed."""
    return _DTYPES_BY_NAME.get(name)


def _string_dtype(value: str) -> np.dtype | None:
    """The dtype a string names: jmp's short names ("f16", "bf16", "f32", "half", ...), or a
    full dtype name; None for anything else."""
    value = value.strip()
    if value == "half":
        return half_dtype()
    if value in _DTYPE_ALIASES:
        return np.dtype(jnp.dtype(_DTYPE_ALIASES[value]))
    return named_dtype(value)


def normalise_dtype(value: Any, argument: str) -> np.dtype:
    """`value` as a NumPy dtype: one of JAX's floating dtypes, given as a dtype, a type or a
    name (jmp's short names too: "f16", "bf16", "f32", "half"). None is refused, not read as
    float64 as NumPy reads it."""
    accepted = "float16, bfloat16, float32, float64 or a float8 dtype"
    if value is None:
        raise TypeError(f"Expected a floating dtype ({accepted}) for `{argument}`, got None.")
    if isinstance(value, (np.ndarray, jax.Array, np.generic)):  # NumPy reads a value's dtype
        raise TypeError(
            f"Expected a floating dtype ({accepted}) for `{argument}`, got a value; pass its "
            "`.dtype`."
        )
    dtype = _string_dtype(value) if isinstance(value, str) else None
    if dtype is None and not isinstance(value, str):
        try:
            dtype = jnp.dtype(value)
        except TypeError:
            dtype = None
    if dtype is None:
        raise TypeError(f"Expected a floating dtype ({accepted}) for `{argument}`, got {value!r}.")
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"Expected a floating dtype ({accepted}) for `{argument}`, got {dtype.name}, "
            "which is not one."
        )
    if dtype not in _JAX_FLOATS:
        raise TypeError(
            f"Expected a floating dtype JAX computes in ({accepted}) for `{argument}`, got "
            f"{dtype.name} (NumPy's, which JAX does not support)."
        )
    return dtype


def is_floating_array(x: Any) -> bool:
    """Whether `x` is a JAX or NumPy array (or NumPy scalar) of a floating dtype."""
    # Tracers are jax.Array instances, so this covers traced values too.
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) and jnp.issubdtype(
        x.dtype, jnp.floating
    )


def cast_floating(tree: T, dtype: np.dtype) -> T:
    def cast(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
                return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
            return x
        if is_floating_array(x) and x.dtype != dtype:
            # A value past the target's range becomes inf, as JAX's cast makes it, without
            # NumPy's warning for a NumPy leaf.
            with np.errstate(over="ignore"):
                return x.astype(dtype)
        # Already the target dtype: returned as is, so no convert op is traced.
        return x

    return jax.tree.map(cast, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Which dtype parameters, computation and outputs use.

    Attributes:
      param_dtype: the dtype parameters are stored in (the master weights).
      compute_dtype: the dtype of the computation (matmuls, activations).
      output_dtype: the dtype the model's outputs are returned in.

    Dtypes are normalised to `numpy.dtype`, so `Policy(jnp.float16, ...)`,
    `Policy(np.float16, ...)` and `Policy("float16", ...)` are equal and hash
    alike. Only floating dtypes are accepted.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jmp_policy as jmp
      >>> policy = jmp.Policy(jnp.float32, jnp.float16, jnp.float32)
      >>> print(policy)
      params=float32,compute=float16,output=float32
      >>> policy.cast_to_compute({"w": jnp.ones(2), "step": 3})["w"].dtype
      dtype('float16')
    """

    param_dtype: np.dtype
    compute_dtype: np.dtype
    output_dtype: np.dtype

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = normalise_dtype(getattr(self, field.name), field.name)
            object.__setattr__(self, field.name, value)

    def cast_to_param(self, tree: T) -> T:
        """Casts the floating leaves of `tree` to `param_dtype`."""
        return cast_floating(tree, self.param_dtype)

    def cast_to_compute(self, tree: T) -> T:
        """Casts the floating leaves of `tree` to `compute_dtype`."""
        return cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree: T) -> T:
        """Casts the floating leaves of `tree` to `output_dtype`."""
        return cast_floating(tree, self.output_dtype)

    def with_param_dtype(self, param_dtype: DTypeLike) -> Policy:
        """Returns a copy of this policy with another `param_dtype`."""
        return dataclasses.replace(self, param_dtype=param_dtype)

    def with_compute_dtype(self, compute_dtype: DTypeLike) -> Policy:
        """Returns a copy of this policy with another `compute_dtype`."""
        return dataclasses.replace(self, compute_dtype=compute_dtype)

    def with_output_dtype(self, output_dtype: DTypeLike) -> Policy:
        """Returns a copy of this policy with another `output_dtype`."""
        return dataclasses.replace(self, output_dtype=output_dtype)

    def __str__(self) -> str:
        compute = BLOCK_FORMATS.get(self.compute_dtype.name, self.compute_dtype.name)
        return f"params={self.param_dtype.name},compute={compute},output={self.output_dtype.name}"


def _suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


# Spellings people write for the words of a preset name.
_WORD_ALIASES = {
    "fp16": "float16", "f16": "float16", "half": "float16", "float16": "float16",
    "bf16": "bfloat16", "bfloat": "bfloat16", "bfloat16": "bfloat16",
    "mixed": "mixed", "mix": "mixed", "amp": "mixed",
}  # fmt: skip
_FLOAT8_NAMES = ("float8_e4m3fn", "float8_e5m2")


def _closest_policy_name(name: str) -> str | None:
    """The preset or dtype a mistyped policy name most likely meant.

    Presets first: `mixed-float16`, `mixed_fp16` and `fp16_mixed` mean
    `mixed_float16`, not the pure `float16` that spelling is closest to.
    """
    words = [w for w in re.split(r"[\s_\-./]+", name.lower()) if w]
    known = [_WORD_ALIASES.get(w, w) for w in words]
    halves = [w for w in known if w in ("float16", "bfloat16")]
    if len(words) == 2 and words[0] in _KEY_ALIASES:
        return f"{words[0]}={words[1]}"  # compute_float16: the 'key=dtype' form
    if "mixed" in known and len(set(halves)) == 1:
        return f"mixed_{halves[0]}"
    for block in BLOCK_FORMATS.values():
        if block in words:
            return f"mixed_{block}"
    if any(w.startswith(("float8", "fp8", "f8", "e4m3", "e5m2")) for w in words):
        return "mixed_float8" if "mixed" in known else _FLOAT8_NAMES[0]
    if len(known) == 1 and known[0] in ("float16", "bfloat16") and known[0] != name:
        # A newcomer's "fp16" means mixed precision: float32 master weights.
        return f"mixed_{known[0]}"
    choices = [*_PRESETS, "float32", "float16", "bfloat16", *_DTYPE_ALIASES]
    close = difflib.get_close_matches(name.lower(), choices, n=1)
    return close[0] if close else None


def _unknown_policy_name(name: str, argument: str = "policy_name") -> ValueError:
    guess = _closest_policy_name(name)
    return ValueError(
        # "Unknown dtype" first: jmp's own tests (run against us) match it.
        f"Unknown dtype or policy name {name!r} for `{argument}`: expected a preset "
        f"({', '.join(_PRESETS)}: float32 params and outputs, lower-precision compute), a "
        f"dtype for everything ({', '.join(['half', *_DTYPE_ALIASES])}, or another floating "
        "dtype such as float8_e4m3fn), or 'key=dtype' pairs such as "
        "'params=float32,compute=float16,output=float32'."
        + (f" Did you mean {guess!r}?" if guess else "")
        + (
            f" ({guess}: float32 parameters, {guess[6:]} compute; {guess[6:]!r} puts "
            "everything, parameters too, in it.)"
            if guess in ("mixed_float16", "mixed_bfloat16")
            else ""
        )
    )


def _parse_dtype(value: str, policy_name: str, argument: str = "policy_name") -> np.dtype:
    value = value.strip()
    # jmp's names, or any other floating dtype name JAX knows (e.g. float8_e4m3fn), so that
    # `str(policy)` round-trips for every policy.
    dtype = _string_dtype(value)
    if dtype is not None and dtype in _JAX_FLOATS:
        return dtype
    accepted = ", ".join(["half", *_DTYPE_ALIASES])
    raise ValueError(
        f"Unknown dtype {value!r} in `{argument}` {policy_name!r}: expected one of "
        f"{accepted}.{_suggest(value, ['half', *_DTYPE_ALIASES])}"
    )


def get_policy(policy_name: str) -> Policy:
    """Parses a policy from a string.

    Accepts jmp's grammar: comma-separated `key=dtype` pairs with keys `params`
    (`p`), `compute` (`c`) and `output` (`o`), and dtypes `full`, `half`, `f32`,
    `float32`, `f16`, `float16`, `bf16`, `bfloat16`, `f64`, `float64`. Missing
    keys default to params=float32, compute=params, output=compute. A lone
    dtype name sets all three. Keras' presets `mixed_float16` and
    `mixed_bfloat16` mean float32 params and outputs with half compute;
    `mixed_float8` means float32 params and outputs with float8_e4m3fn compute,
    which `autocast` runs as float8 matmuls (`jmp_policy.fp8`) and bfloat16
    for everything else. `mixed_mxfp8` and `mixed_nvfp4` run the matmuls in
    those block-scaled formats (`jmp_policy.block_scaled`); their long form is
    "params=float32,compute=mxfp8,output=float32" (the compute dtype names the
    format: float8_e8m0fnu, MXFP8's scale type, or float4_e2m1fn, NVFP4's
    value type).

    Args:
      policy_name: the policy string, e.g. "params=float32,compute=float16".

    Returns:
      The `Policy`.

    Raises:
      TypeError: `policy_name` is not a string.
      ValueError: unknown key or dtype, a key given twice, or a malformed pair.

    Examples:
      >>> import jmp_policy as jmp
      >>> print(jmp.get_policy("c=bf16, o=f32"))
      params=float32,compute=bfloat16,output=float32
      >>> print(jmp.get_policy("mixed_float16"))
      params=float32,compute=float16,output=float32
    """
    return _parse_policy(policy_name, "policy_name")


def _parse_policy(policy_name: Any, argument: str) -> Policy:
    """`get_policy`'s parser; its errors name `argument` (a model integration's `policy`)."""
    if not isinstance(policy_name, str):
        raise TypeError(
            f"Expected a string such as 'params=float32,compute=float16' or "
            f"'mixed_float16' for `{argument}`, got {type(policy_name).__name__}."
        )
    name = policy_name.strip()
    if name in _PRESETS:
        compute = np.dtype(jnp.dtype(_PRESET_COMPUTE[name]))
        return Policy(np.dtype(np.float32), compute, np.dtype(np.float32))
    if "=" not in name:
        if not name:
            raise ValueError(
                f"Expected a dtype, a preset or 'key=dtype' pairs for `{argument}`, "
                "got an empty string."
            )
        try:
            dtype = _parse_dtype(name, policy_name, argument)
        except ValueError:
            raise _unknown_policy_name(name, argument) from None
        return Policy(dtype, dtype, dtype)

    chosen: dict[str, np.dtype] = {}
    for part in name.split(","):
        pieces = part.split("=")
        if len(pieces) != 2:
            raise ValueError(
                f"Expected comma-separated 'key=dtype' pairs for `{argument}`, got "
                f"{part.strip()!r} in {policy_name!r}."
            )
        key, value = pieces[0].strip(), pieces[1]
        if key not in _KEY_ALIASES:
            raise ValueError(
                f"Unknown key {key!r} in `{argument}` {policy_name!r}: expected one of "
                f"params (p), compute (c), output (o).{_suggest(key, _KEY_ALIASES)}"
            )
        key = _KEY_ALIASES[key]
        if key in chosen:
            raise ValueError(f"Key {key!r} is given twice in `{argument}` {policy_name!r}.")
        chosen[key] = _parse_dtype(value, policy_name, argument)
    params = chosen.get("params", np.dtype(np.float32))
    compute = chosen.get("compute", params)
    output = chosen.get("output", compute)
    return Policy(params, compute, output)


def check_model_policy(given: Any, integration: str) -> Policy:
    """`check_policy(given)` for a policy applied to a model by `integration`, which warns (at
    the user's line) when `given` names one dtype ("f16", "half", "float16", "bf16"): jmp's
    names for that dtype everywhere, master weights too, where a newcomer meant mixed
    precision. A `Policy` or 'key=dtype' pairs that ask for 16-bit parameters (with
    `low_precision_optimizer`) are taken as meant."""
    policy = check_policy(given)
    if policy.param_dtype.itemsize > 2 or not isinstance(given, str) or "=" in given:
        return policy
    half = policy.param_dtype.name
    warn_once_per_mistake(
        HALF_MASTER_WEIGHTS,
        f"Expected float32 parameters (master weights) from the policy given to {integration}, "
        f"got {given!r} ({policy}): every weight update would run in {half}, where small "
        f"updates round away. Did you mean 'mixed_{half}'? (float32 parameters, {half} "
        f"compute; {given!r} puts everything, parameters too, in {half}.)",
        UserWarning,
    )
    return policy


def check_policy(policy: Any, argument: str = "policy") -> Policy:
    """Returns `policy` as a `Policy`: a `Policy` as is, a name through `get_policy`.

    Anything else (a dtype, another object) raises a TypeError naming
    `argument` and saying what to pass instead.
    """
    if isinstance(policy, str):
        return _parse_policy(policy, argument)
    if not isinstance(policy, Policy):
        dtype = None
        if not isinstance(policy, (np.ndarray, jax.Array, np.generic)):  # not read as a dtype
            try:
                dtype = jnp.dtype(policy)
            except TypeError:
                dtype = None
        if dtype is not None and not isinstance(policy, str):
            half = f"mixed_{dtype.name}" if dtype.name in ("float16", "bfloat16") else None
            fix = (
                f"For mixed precision (float32 master weights, {dtype.name} compute) pass "
                f"'{half}' or jmp_policy.get_policy('{half}'); "
                if half
                else ""
            )
            raise TypeError(
                f"Expected a jmp_policy.Policy or a policy name for `{argument}`, got the dtype "
                f"{dtype.name}. A policy has three dtypes (params, compute, output). {fix}to "
                f"run everything in {dtype.name}, pass '{dtype.name}'."
            )
        raise TypeError(
            "Expected a jmp_policy.Policy (e.g. jmp_policy.get_policy('mixed_float16')) or a "
            f"policy name for `{argument}`, got {type(policy).__name__}: {policy!r}."
        )
    return policy


def casting_policy(policy: Policy) -> Policy:
    """The policy an integration that casts (Linen, NNX) casts with.

    `policy` itself, except that a float8 compute dtype becomes bfloat16:
    float8 cannot hold parameters and activations without a scale (e4m3 tops
    out at 448 with 3 mantissa bits), so under `mixed_float8` everything is
    cast to bfloat16 and only the matmuls quantize their operands to float8,
    each with its own scale (`jmp_policy.fp8.Fp8DotGeneral`).

    Examples:
      >>> import jmp_policy as jmp
      >>> from jmp_policy.policy import casting_policy
      >>> print(casting_policy(jmp.get_policy("mixed_float8")))
      params=float32,compute=bfloat16,output=float32
    """
    if policy.compute_dtype.itemsize == 1:
        return policy.with_compute_dtype(jnp.bfloat16)
    return policy


def cast_to_full(tree: T) -> T:
    """Casts the floating leaves of `tree` to float32."""
    return cast_floating(tree, np.dtype(np.float32))


def cast_to_half(tree: T) -> T:
    """Casts the floating leaves of `tree` to `half_dtype()`."""
    return cast_floating(tree, half_dtype())


__all__ = [
    "Policy",
    "cast_to_full",
    "cast_to_half",
    "get_policy",
    "half_dtype",
]
