"""What a kernel family is: the contract between one kernel and the rest of the compiler.

A family bundles its spec type, its template, its lowering, its frozen ``Config`` type
with a search space and a feasibility rule, a heuristic default, a bucket rule, and a
``Problem`` that makes fresh inputs for a bucket and checks an output against the
family's reference. Codegen, tuning, the database, dispatch and the CLI see families
only through this interface (``tilegen.families.family_of``).
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

import torch

from tilegen.device import DeviceInfo
from tilegen.dtypes import TORCH_DTYPES
from tilegen.families.buckets import Buckets
from tilegen.ir import Spec
from tilegen.triton_internals.launch import Launcher

__all__ = ["TOLERANCE", "Config", "ConfigError", "Family", "Problem", "RowBlockConfig", "RowsProblem", "relative_error"]

#: Largest relative Frobenius error an output may show against its reference, by spec dtype.
TOLERANCE = {"fp16": 1e-2, "bf16": 1e-2, "fp32": 1e-4}


class ConfigError(ValueError):
    """A config value that the kernel cannot take, naming the knob."""


@dataclass(frozen=True, order=True)
class Config:
    """Launch parameters of one kernel: positive ints, one field per knob, except the on/off
    ``switches`` (0 or 1) and the ``choices`` (one of a few ints, 0 among them).

    A config's identity is its canonical JSON (``to_json``): two configs that differ in
    any knob are two trials and two rows. ``str`` is only a short label for people.
    """

    switches: ClassVar[frozenset[str]] = frozenset()
    choices: ClassVar[Mapping[str, tuple[int, ...]]] = MappingProxyType({})

    def to_dict(self) -> dict[str, int]:
        """The knobs by name; the names are the generated launcher's keyword arguments."""
        # Not dataclasses.asdict: its deep copy costs microseconds on a per-call path.
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def knobs(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        names = cls.knobs()
        if not isinstance(data, dict):
            raise ConfigError(f"config: expected an object, got {data!r}")
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ConfigError(f"{unknown[0]}: unknown knob; known: {', '.join(names)}")
        # A knob added later has a default (its feature off): rows written before it still read.
        defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
        data = {**defaults, **data}
        missing = [n for n in names if n not in data]
        if missing:
            raise ConfigError(f"{missing[0]}: missing")
        for n in names:
            if isinstance(data[n], bool) or not isinstance(data[n], int):
                raise ConfigError(f"{n}: expected an int, got {data[n]!r}")
            if n in cls.switches:
                if data[n] not in (0, 1):
                    raise ConfigError(f"{n}: expected 0 (off) or 1 (on), got {data[n]!r}")
            elif n in cls.choices:
                if data[n] not in cls.choices[n]:
                    raise ConfigError(f"{n}: expected one of {', '.join(map(str, cls.choices[n]))}, got {data[n]!r}")
            elif data[n] < 1:
                raise ConfigError(f"{n}: expected a positive int, got {data[n]!r}")
        return cls(**{n: data[n] for n in names})

    def __str__(self) -> str:
        return "-".join(f"{name}{value}" for name, value in self.to_dict().items())


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """``(||out - ref|| / ||ref||, max |out - ref|)`` in ``ref``'s dtype; ``inf`` for any NaN in ``out``."""
    if torch.isnan(out).any():
        return float("inf"), float("inf")
    diff = out.to(ref.dtype) - ref
    if diff.numel() == 0:
        return 0.0, 0.0
    return float(diff.norm() / ref.norm().clamp_min(1e-30)), float(diff.abs().max())


def lse_error(lse: torch.Tensor, ref_lse: torch.Tensor) -> tuple[float, float]:
    """``relative_error`` of an LSE output: a row that sees no key has ``-inf``, and only ``-inf`` says so. Those
    rows must match the reference's exactly (not ``+inf``, not a finite value) and are left out of the relative
    error, which a ``-inf`` would make NaN; NaN anywhere, or ``+inf``, is ``inf``."""
    got = lse.to(ref_lse.dtype)
    empty = torch.isneginf(ref_lse)
    if torch.isnan(got).any() or torch.isposinf(got).any() or not torch.equal(torch.isneginf(got), empty):
        return float("inf"), float("inf")
    return relative_error(got[~empty], ref_lse[~empty])


class Problem(abc.ABC):
    """One bucket's measurement problem on one kind of device: inputs, launch, check, cost.

    Instances are pickled to the tuning worker, so they hold plain values only.
    """

    spec: Spec
    on_gpu: bool
    #: Time a trial's launch replayed from a CUDA graph (``tilegen.tuning.measure.replayable``), so
    #: that a short kernel is not timed with its host-side launch.
    timed_from_graph: ClassVar[bool] = True

    @classmethod
    def for_bucket(cls, spec: Spec, bucket: int, *, on_gpu: bool, **shape: Any) -> Problem:
        """The problem a tuning trial at ``bucket`` measures (``Family.problem`` calls this); ``shape``
        overrides family-specific sizes (a benchmark's batch and head count, say)."""
        raise NotImplementedError(f"{cls.__qualname__}: a family's Problem makes itself from a bucket (for_bucket)")

    @abc.abstractmethod
    def inputs(self, seed: int) -> Any:
        """Fresh random inputs (never zeros, so a kernel that skips work shows)."""

    def placeholder_inputs(self) -> Any:
        """Inputs with ``inputs(0)``'s shapes, dtypes and strides whose values do not matter: all a
        compile needs. Compile-ahead builds them on torch's meta device, where nothing computed
        from values can run; a Problem whose inputs are computed from values (a page table from
        its lengths) builds its buffers here without that."""
        return self.inputs(0)

    @abc.abstractmethod
    def outputs(self, inputs: Any) -> Any:
        """Output buffers poisoned with NaN, the main output first: any element the kernel leaves
        unwritten fails the check."""

    @abc.abstractmethod
    def launch(self, launcher: Launcher, config: Config, inputs: Any, outputs: Any) -> None:
        """Run the generated kernel once, writing ``outputs``, through ``launcher.launch`` (the generated
        ``launch``'s signature): the tuner passes the ``Launcher`` the ops replay, compile-ahead the
        generated module itself."""

    @abc.abstractmethod
    def check(self, inputs: Any, outputs: Any) -> tuple[float, float]:
        """``(relative error, max abs error)`` of ``outputs`` against the family's reference; ``inf`` on NaN."""

    @abc.abstractmethod
    def flops(self) -> float:
        """Floating-point operations one launch must do."""

    @abc.abstractmethod
    def bytes_moved(self) -> float:
        """The least bytes one launch must read and write."""

    @property
    def tolerance(self) -> float:
        return TOLERANCE[self.spec.dtype]

    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.spec.dtype]


@dataclass(frozen=True, order=True)
class RowBlockConfig(Config):
    """Launch parameters of a kernel over ``[tokens, heads, head_dim]`` rows (``merge_states``,
    ``rope``): rows ((token, head) pairs) per program, and warps."""

    block_r: int
    num_warps: int

    def __str__(self) -> str:
        return f"R{self.block_r}-w{self.num_warps}"


@dataclass(frozen=True)
class RowsProblem(Problem):
    """A problem over ``[tokens, heads, head_dim]`` rows whose bucket counts them (tokens x heads)."""

    spec: Spec
    tokens: int
    heads: int
    on_gpu: bool

    @classmethod
    def for_bucket(cls, spec: Spec, bucket: int, *, on_gpu: bool, heads: int | None = None) -> RowsProblem:
        """On a GPU 32 heads (Llama's query heads) and the tokens that fill the bucket; under the
        interpreter 5 heads and an odd token count below 48 rows, so the rows are no multiple of any
        block."""
        if on_gpu:
            heads = heads or min(32, bucket)
            return cls(spec, max(1, bucket // heads), heads, True)
        heads = heads or 5
        return cls(spec, max(1, min(bucket, 48) // heads) | 1, heads, False)

    @property
    def rows(self) -> int:
        return self.tokens * self.heads


_NEAREST: dict[tuple[str, Spec, Config, DeviceInfo], Config] = {}

#: Shared memory a block may use on Hopper (227 KiB), the GPU the attention families' search spaces were sized on.
HOPPER_SMEM = 232448


def with_smaller(space: dict[str, list[int]], device: DeviceInfo, **smaller: tuple[int, ...]) -> dict[str, list[int]]:
    """``space`` with each ``smaller`` knob's values added, on a GPU with less shared memory than Hopper's (an A100's
    163 KiB, sm86/sm89's 99 KiB): there the spaces sized on the H200 hold no config at all for the widest fp32
    specs (head dims past 128), whose default then could not compile."""
    if device.is_interpreter or device.smem_bytes >= HOPPER_SMEM:
        return space
    return {name: sorted({*values, *smaller.get(name, ())}) for name, values in space.items()}


def config_distance(config: Config, other: Config) -> tuple[float, float]:
    """How far ``other`` is from ``config``, smaller first: the halvings or doublings over their sizes (a stage of
    three to two counts log2(3/2)) and one for each other knob changed; then, on a tie, the one that asks less."""
    far = larger = 0.0
    for name in config.knobs():
        a, b = getattr(config, name), getattr(other, name)
        if a != b:
            # A choice names a kernel (wgmma 1, 2, 3), not a size.
            step = abs(math.log2(b / a)) if a > 0 and b > 0 and name not in config.choices else 1.0
            far += step
            larger += step if b > a else -step
    return far, larger


def nearest(config: Config, options) -> Config:
    """Of ``options``, the one nearest to ``config`` (``config_distance``), the first on a tie; ``config`` itself
    where there is none."""
    return min(options, key=lambda other: config_distance(config, other), default=config)


@dataclass(frozen=True, eq=True, repr=False)
class Family:
    """One kernel family, declared as values: ``FAMILY = Family(name=..., spec_type=..., ...)``.

    Families are registered once (``tilegen.families.register``) and compared by value, so that
    the copy a tuning worker unpickles equals the family it came from: the functions and types
    travel as references to their modules, which the worker imports.

    Fields:
        name: the registry's name, also the spec type's ``family`` and the JSON ``"family"``.
        spec_type, config_type: the family's frozen dataclasses.
        template: the Jinja template that renders the kernel and its ``launch`` function.
        buckets: what a tuning bucket means for this family, the nearest-bucket rule, and the
            sizes ``tilegen tune`` tunes by default.
        lower(spec) -> dict: decides everything about the generated source; the template's values.
        search_space(spec, device) -> {knob: [values]}: every knob and its values; ``feasible``
            then removes what the kernel cannot run.
        feasible(spec, config, device) -> str | None: ``None`` when the kernel can run ``config``,
            else the reason it cannot.
        default_rule(spec, device) -> [(largest bucket, config), ...]: heuristic defaults, ending
            with ``None`` (every larger bucket).
        problem_type: the ``Problem`` a tuning trial measures; its classmethod
            ``for_bucket(spec, bucket, *, on_gpu, **shape)`` makes one (see ``problem``).
        presets: named specs users tune most (``tilegen tune --preset NAME``).
        template_dir: the folder holding ``template``; ``None`` is tilegen's own ``templates/``.
            Shared pieces (``common/...``) always resolve from tilegen's ``templates/``.
        standalone: optional ``standalone(family, spec, tuned, device, *, template_hash,
            triton_version) -> str``, what ``tilegen emit --tuned`` appends (see
            ``standalone_entry_point``).
        rows_from: optional ``rows_from(spec) -> (spec, ...)``: specs of this family whose tuned rows
            serve a bucket ``spec`` has no row of its own for, first one first, where ``feasible``
            takes their config for ``spec`` (a forward that also writes its LSE runs well on the
            configs tuned without it, and training calls it with no rows of its own).
    """

    name: str
    spec_type: type[Spec]
    config_type: type[Config]
    template: str
    buckets: Buckets
    lower: Callable[[Spec], dict[str, Any]]
    search_space: Callable[[Spec, DeviceInfo], dict[str, list[int]]]
    feasible: Callable[[Spec, Config, DeviceInfo], str | None]
    default_rule: Callable[[Spec, DeviceInfo], list[tuple[int | None, Config]]]
    problem_type: type[Problem]
    presets: dict[str, Spec] = dataclasses.field(default_factory=dict)
    template_dir: Path | None = None
    standalone: Callable[..., str] | None = None
    rows_from: Callable[[Spec], tuple[Spec, ...]] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"name: expected an identifier such as 'row_softmax', got {self.name!r}")
        for field, base in (("spec_type", Spec), ("config_type", Config), ("problem_type", Problem)):
            value = getattr(self, field)
            if not (isinstance(value, type) and issubclass(value, base)):
                raise TypeError(f"{field}: expected a subclass of {base.__name__}, got {value!r}")
        if getattr(self.spec_type, "family", None) != self.name:
            raise ValueError(f"spec_type: {self.spec_type.__name__}.family is {getattr(self.spec_type, 'family', None)!r}, "
                             f"not the family's name {self.name!r}")
        if not isinstance(self.buckets, Buckets):
            raise TypeError(f"buckets: expected a Buckets rule such as PowerOfTwoBuckets('rows'), got {self.buckets!r}")
        for field in ("lower", "search_space", "feasible", "default_rule"):
            if not callable(getattr(self, field)):
                raise TypeError(f"{field}: expected a function, got {getattr(self, field)!r}")
        for field in ("standalone", "rows_from"):
            if getattr(self, field) is not None and not callable(getattr(self, field)):
                raise TypeError(f"{field}: expected a function or None, got {getattr(self, field)!r}")
        if self.template_dir is not None:
            # A str would be a different value after a round trip through a Path, and so a different family.
            object.__setattr__(self, "template_dir", Path(self.template_dir))

    def problem(self, spec: Spec, bucket: int, *, on_gpu: bool, **shape: Any) -> Problem:
        """The problem a tuning trial at ``bucket`` measures; ``shape`` overrides family-specific
        sizes (a benchmark's batch and head count, say)."""
        # Looked up on the type at each call, not stored: a test may replace ``for_bucket`` for a while.
        return self.problem_type.for_bucket(spec, bucket, on_gpu=on_gpu, **shape)

    def candidates(self, spec: Spec, device: DeviceInfo) -> list[Config]:
        """The feasible part of the search space, in a stable order."""
        space = self.search_space(spec, device)
        names = self.config_type.knobs()
        grid = itertools.product(*(space[n] for n in names))
        configs = [self.config_type(**dict(zip(names, values))) for values in grid]
        return [c for c in configs if self.feasible(spec, c, device) is None]

    def default_config(self, spec: Spec, device: DeviceInfo, bucket: int) -> Config:
        """The heuristic config for a bucket with no tuned entry (see ``fitted_default_rule``)."""
        for largest, config in self.fitted_default_rule(spec, device):
            if largest is None or bucket <= largest:
                return config
        raise AssertionError(f"{self.name}: default_rule must end with a None bound")

    def fitted_default_rule(self, spec: Spec, device: DeviceInfo) -> list[tuple[int | None, Config]]:
        """``default_rule`` with each config the device cannot run (``feasible`` says why) replaced by the
        feasible config of the search space nearest to it (``nearest_feasible``). The rules were fitted on
        Hopper; a GPU with less shared memory (an A100's 163 KiB, an sm86/sm89 card's 99 KiB) would otherwise
        fail to compile the untuned calls Hopper's tiles fill."""
        return [(largest, config if self.feasible(spec, config, device) is None
                 else self.nearest_feasible(spec, config, device))
                for largest, config in self.default_rule(spec, device)]

    def nearest_feasible(self, spec: Spec, config: Config, device: DeviceInfo) -> Config:
        """The feasible config nearest to ``config`` (``config_distance``), the first in the search space's order
        on a tie; ``config`` itself where nothing is feasible (the launch says why). Remembered: a search space
        of thousands (the cascade's) takes a good part of a second to walk, once per bucket of every table."""
        key = (self.name, spec, config, device)
        found = _NEAREST.get(key)
        if found is None:
            found = _NEAREST[key] = nearest(config, self.candidates(spec, device))
        return found

    def standalone_entry_point(
        self, spec: Spec, tuned: dict[int, tuple[Config, str]], device: DeviceInfo, *,
        template_hash: str, triton_version: str,
    ) -> str:
        """Source appended by ``tilegen emit --tuned``: the tuned table (config and source file by
        bucket), the bucket rule and an entry point, so the module runs with torch and triton alone."""
        if self.standalone is None:
            raise NotImplementedError(f"family {self.name!r} has no standalone entry point for `emit --tuned`")
        return self.standalone(self, spec, tuned, device, template_hash=template_hash, triton_version=triton_version)

    def __repr__(self) -> str:
        return f"<kernel family {self.name}>"

    def __hash__(self) -> int:
        # Equal families share a name; presets (a dict) keep the fields from hashing as a tuple.
        return hash(self.name)
