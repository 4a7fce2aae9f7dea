"""autocast's module, not hidden by the function: the transforms (`autocast`,
`full_precision`, `cast_at_use`) and the op lists they follow (`ALLOW`: primitives run in
the compute dtype; `DENY`: in float32; `NO_HALF_KERNEL`: always float32). `jmp_policy.autocast`
is the function at the top level (its implementation: `jmp_policy._autocast`)."""

from jmp_policy._autocast.transforms import (
    ALLOW,
    DENY,
    NO_HALF_KERNEL,
    autocast,
    cast_at_use,
    full_precision,
)

__all__ = ["ALLOW", "DENY", "NO_HALF_KERNEL", "autocast", "cast_at_use", "full_precision"]
