"""Deprecated path: `jmp_policy.activations` is now the private
`jmp_policy._autocast.activations`: it holds autocast's internals; its op lists are in
jmp_policy.casting. This module goes in the next release."""

import warnings

from jmp_policy._autocast.activations import *  # noqa: F403

warnings.warn(
    "jmp_policy.activations is deprecated (now private): it holds autocast's internals; "
    "its op lists are in jmp_policy.casting. The path goes in the next release.",
    DeprecationWarning,
    stacklevel=2,
)
