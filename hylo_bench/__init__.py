"""hylo-bench: upcycle Transformers into HyLo hybrids and measure them."""

__version__ = "0.1.0"
