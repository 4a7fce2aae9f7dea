"""The environment of a subprocess that runs JAX on forced CPU devices."""

import os


def env_with_devices(count: int) -> dict[str, str]:
    """os.environ with `count` forced host devices added to XLA_FLAGS. The other flags stay
    (the suite's LLVM optimisation level among them: the subprocesses compile as fast as the
    workers); a device count already there is replaced."""
    flags = [
        flag
        for flag in os.environ.get("XLA_FLAGS", "").split()
        if not flag.startswith("--xla_force_host_platform_device_count")
    ]
    flags.append(f"--xla_force_host_platform_device_count={count}")
    return {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
