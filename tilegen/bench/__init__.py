"""Benchmarks, each a module with ``main(argv)``: ``tilegen bench NAME`` (or ``python -m
tilegen.bench.NAME``) runs one, tilegen and its peers measured in the same run."""


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend; ``None`` where matplotlib is not
    installed (the benchmarks' plots are optional)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
