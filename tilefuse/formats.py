"""Number formats and scale-factor layouts (quant.md section 1), shared by references, tests and kernels."""

__all__: list[str] = []
