"""From IR to executables: resolve targets to kernels and run ops."""

from .kernels import decode_args, execute_op, resolve_target

__all__ = ["decode_args", "execute_op", "resolve_target"]
