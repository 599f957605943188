"""Benchmarks, each a module with ``main(argv)``: ``tilegen bench NAME`` (or ``python -m
tilegen.bench.NAME``) runs one, tilegen and its peers measured in the same run."""

import contextlib
from unittest import mock


def require_gpu(name: str) -> None:
    """Refuse, in one line, to run benchmark ``name`` (its module's name) where there is no CUDA GPU to time."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(f"{name} times CUDA kernels; run it on a GPU")


def whole_numbers(text: str, least: int = 1, *, skip_empty: bool = False) -> list[int] | None:
    """A comma-separated list of whole numbers (digits only), each at least ``least``; ``None`` for anything else,
    or for no number at all. ``skip_empty`` passes over empty items ("16,,32"). The caller's message names its
    flag."""
    items = [x for x in text.split(",") if x or not skip_empty]
    if not items or not all(x.isdigit() and int(x) >= least for x in items):
        return None
    return [int(x) for x in items]


def parse_head_dims(item: str) -> tuple[int, int | None] | None:
    """``D`` or ``D/DV`` (a V of DV columns, as DeepSeek's 192/128) as ``(D, DV or None)``; ``None`` unless both are
    positive whole numbers. The benchmarks' ``--head-dims`` say which flag it was."""
    dims = item.split("/")
    if len(dims) > 2 or not all(d.isdigit() and int(d) > 0 for d in dims):
        return None
    return int(dims[0]), int(dims[1]) if len(dims) == 2 else None


def take_turns(timers: dict, rounds: int) -> tuple[dict[str, list], dict[str, Exception]]:
    """Each of ``timers`` (name -> a function of no argument that times its provider once) called once a round for
    ``rounds`` rounds, the order rotating each round, so that a drift of the GPU's clocks within a case weighs on
    every provider alike. Returns each provider's results by round, and the exception of each that raised (it is
    not called again)."""
    found: dict[str, list] = {name: [] for name in timers}
    failed: dict[str, Exception] = {}
    order = list(timers)
    for r in range(rounds if order else 0):
        for name in order[r % len(order):] + order[:r % len(order)]:
            if name in failed:
                continue
            try:
                found[name].append(timers[name]())
            except Exception as e:  # a peer missing on this GPU/torch (or out of memory) is n/a, not fatal
                failed[name] = e
                del found[name]
    return found, failed


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


@contextlib.contextmanager
def forced_config(family_name: str, config):
    """Calls of ``family_name``'s specs run ``config``: the family's default rule gives it for every size, and tuned
    rows are set aside (dispatch reads none), so a sweep measures the configs it names."""
    import tilegen.db.lookup
    from tilegen import dispatch
    from tilegen.families import registry

    family = registry.get(family_name)
    rule = family.default_rule
    # A family is a frozen dataclass: its rule is swapped under it for the sweep, and put back. The fitted rule too,
    # which would put the nearest feasible config in the place of one the kernel refuses: the sweep reports those.
    forced = lambda spec, device: [(None, config)]  # noqa: E731
    object.__setattr__(family, "default_rule", forced)
    object.__setattr__(family, "fitted_default_rule", forced)
    try:
        with mock.patch.object(tilegen.db.lookup, "tuned_rows", lambda **key: {}):
            dispatch.reset()
            yield
    finally:
        object.__setattr__(family, "default_rule", rule)
        object.__delattr__(family, "fitted_default_rule")
        dispatch.reset()
