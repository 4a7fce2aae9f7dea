"""The module path of autocast's transforms, kept: `autocast`, `full_precision`, `cast_at_use`
and the op lists `ALLOW`, `DENY`, `NO_HALF_KERNEL` (`jmp_policy.casting` is the module to
import them from: the function `jmp_policy.autocast` hides this module's attributes)."""

from jmp_policy._autocast.transforms import ALLOW as ALLOW
from jmp_policy._autocast.transforms import DENY as DENY
from jmp_policy._autocast.transforms import NO_HALF_KERNEL as NO_HALF_KERNEL
from jmp_policy._autocast.transforms import autocast as autocast
from jmp_policy._autocast.transforms import cast_at_use as cast_at_use
from jmp_policy._autocast.transforms import full_precision as full_precision

__all__ = ["ALLOW", "DENY", "NO_HALF_KERNEL", "autocast", "cast_at_use", "full_precision"]
