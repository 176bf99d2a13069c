"""From IR to executables: resolve targets to kernels (only registered ones) and run ops."""

from .kernels import (
    KERNELS,
    SUPPORTED,
    decode_args,
    execute_op,
    register_kernel,
    require_registered,
    resolve_target,
)

__all__ = ["KERNELS", "SUPPORTED", "decode_args", "execute_op", "register_kernel", "require_registered",
           "resolve_target"]
