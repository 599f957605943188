"""``tuned_rows``: what dispatch reads, once per (spec, device), from the user's and the shipped database.

The op must run even when a database cannot be read: a broken, foreign or newer file
costs one warning and its rows, never an exception. Both files are opened read-only,
so an inference process never creates, migrates or locks a database. They are read with
the standard library's sqlite3 (``tilegen.db.sqlite``): SQLAlchemy and the models are for
writers, and cost a first call more than the query. Any known schema revision reads, so
an older shipped file (inside a read-only wheel) needs no upgrade.

Rows are keyed on the Triton they were tuned with, and a torch upgrade brings a new Triton
with no rows of its own: the shipped ones were all tuned under one version. So a bucket the
installed Triton has no row for is served the row of the nearest Triton version that has one
(``serving_order``), once the installed Triton is shown to be able to run its config; a row
of the installed Triton always wins. ``served_rows`` makes the same choice for ``tilegen db``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

from packaging.version import InvalidVersion, Version

from tilegen import env
from tilegen.db.errors import DatabaseError
from tilegen.db.sqlite import read_tuned
from tilegen.db.rows import TunedRow
from tilegen.db.validate import RowError, check_best, config_from_json, runnable_here, safe_text
from tilegen.device import DeviceInfo
from tilegen.families import Config, family_of
from tilegen.ir import Spec

__all__ = ["TunedRows", "served_rows", "serving_order", "tuned_rows"]

log = logging.getLogger("tilegen.db")

_warned: set[str] = set()


class TunedRows(dict[int, tuple[Config, str]]):
    """``tuned_rows``'s answer: ``(config, source file)`` by bucket, a plain dict to every reader, which
    also says which rows another Triton tuned: ``tuned_under`` maps such a row's bucket to that Triton's
    version, ``triton_version`` is the installed one the rows were chosen for (``tilegen.explain`` tells
    the two apart)."""

    def __init__(self, rows=(), *, triton_version: str, tuned_under: Mapping[int, str] | None = None,
                 tuned_for: Mapping[int, str] | None = None):
        super().__init__(rows)
        self.triton_version = triton_version
        self.tuned_under = dict(tuned_under or {})
        # A row tuned for another spec of the family (``Family.rows_from``): its bucket -> that spec's name.
        self.tuned_for = dict(tuned_for or {})

    def note(self, bucket: int) -> str | None:
        """``row_note`` of the row at ``bucket``."""
        return row_note(self.tuned_for.get(bucket), self.tuned_under.get(bucket), self.triton_version)


def row_note(tuned_for: str | None, tuned_under: str | None, installed: str | None) -> str | None:
    """What a user should know about where a served row came from, as ``explain`` and ``emit --tuned`` both say
    it: a row of another spec (``Family.rows_from``) or of another Triton; ``None`` for the row's own."""
    notes = [] if tuned_for is None else [f"tuned for {tuned_for}"]
    if tuned_under is not None:
        notes.append(f"tuned under Triton {tuned_under}; installed {installed}")
    return "; ".join(notes) or None


def serving_order(version: str, installed: str) -> tuple | None:
    """Sort key of a row tuned under Triton ``version`` for a process running ``installed``: smaller serves
    first; ``None`` for a version no order places (one that ``packaging`` cannot read).

    The installed version's rows come first. The others by nearness in version order: the later the
    first part of the release that differs (a micro step is nearer than a minor one), then the fewer
    steps in that part, then the older side on a tie (3.6.0 before 3.8.0 under 3.7.1: a newer Triton
    is built to compile what an older one did, not the reverse), then the nearest on that side
    (3.6.5 before 3.6.0 under 3.7.1). Versions compare as ``packaging`` orders them, never as text.
    """
    if version == installed:
        return (0,)
    try:
        row, here = Version(version), Version(installed)
    except InvalidVersion:
        return None
    width = max(3, len(row.release), len(here.release))
    a, b = (v.release + (0,) * (width - len(v.release)) for v in (row, here))
    differs = next((i for i in range(width) if a[i] != b[i]), width)
    steps = abs(a[differs] - b[differs]) if differs < width else 0
    newer = row > here
    # On the older side the larger release is nearer, on the newer side the smaller.
    within = a if newer else tuple(-part for part in a)
    return (1, width - differs, steps, newer, within, version)


def tuned_rows(
    spec: Spec, device: DeviceInfo, template_hash: str, triton_version: str, *, user_db: Path | None = None
) -> TunedRows:
    """Tuned configs by bucket, each with the database file it came from; per bucket a row of
    ``triton_version`` wins, the user's over the shipped one, else the row of the nearest Triton version
    that has one (``serving_order``; the user's on a tie) and whose config this Triton can run on ``device``.

    ``user_db`` defaults to ``tilegen.env.db_path()``; a file that does not exist is skipped
    (and not created), as is a missing shipped database. A row that fails the writers' checks
    (``tilegen.db.validate.check_best``: a config the family cannot run on ``device``, a bucket
    its rule never gives, a value of the wrong type, as an edited or forged file holds) is
    skipped with a warning, so one bad row never breaks the op. A row of another Triton whose
    config this one cannot run (the Gluon kernel's, under anything but Triton 3.6) is passed over
    quietly for the next nearest: that is no fault of the file.

    A bucket with no row of ``spec``'s own is then served the row of the first of the family's
    ``rows_from(spec)`` that has one and whose config ``feasible`` takes for ``spec`` (``tuned_for``
    names that spec).
    """
    # Per bucket, each row that may serve it: (its order, file preference, config, source, Triton).
    candidates: dict[int, list[tuple]] = {}
    if user_db is None:
        try:
            user_db = env.db_path()
        except FileNotFoundError as e:  # "~name/..." of no user known here: no file, as a missing one is none
            _warn_once(f"tilegen: ignoring the tuning database: TILEGEN_DB: {e}")
    files = (user_db, env.shipped_db_path())
    for preference, path in enumerate(files):  # the user's file first: it wins a tie
        if path is None:
            continue
        try:
            if not path.exists():
                continue
            found = read_tuned(path, spec.hash, template_hash, device.key)
        except OSError as e:  # from exists: a folder on the way this user may not enter, a name too long
            _warn_once(f"tilegen: ignoring the tuning database {safe_text(path, 4096)}: {e.strerror or e}")
            continue
        except DatabaseError as e:
            _warn_once(f"tilegen: ignoring the tuning database: {e}")
            continue
        for row in found:
            try:
                versions = {name: row[name] for name in ("triton_version", "torch_version", "tilegen_version")}
                config = check_best(spec, device, row["bucket"], config_from_json(row["config_json"]), row["time_ms"],
                                    row["max_error"], row["trials"], tflops=row["tflops"], gbps=row["gbps"],
                                    versions=versions, stored=row["triton_version"] != triton_version)
            except RowError as e:
                _warn_once(f"tilegen: ignoring a tuned row of {spec.name} (bucket {safe_text(repr(row['bucket']), 40)}) "
                           f"in {safe_text(path)}: {e}")
                continue
            order = serving_order(row["triton_version"], triton_version)
            if order is None:
                continue
            candidates.setdefault(row["bucket"], []).append(
                (order, preference, config, str(path), row["triton_version"]))
    rows = TunedRows(triton_version=triton_version)
    for bucket, found in candidates.items():
        for order, _, config, source, version in sorted(found, key=lambda c: c[:2]):
            if version != triton_version:
                try:
                    config = runnable_here(spec, device, config.to_dict())
                except RowError as e:
                    log.debug("tilegen: not serving the Triton %s row of %s (bucket %s) from %s under Triton %s: %s",
                              version, spec.name, bucket, source, triton_version, e)
                    continue
                rows.tuned_under[bucket] = version
            rows[bucket] = (config, source)
            break
    family = family_of(spec)
    for kin in family.rows_from(spec) if family.rows_from is not None else ():
        served = tuned_rows(kin, device, template_hash, triton_version, user_db=user_db)
        for bucket, (config, source) in served.items():
            if bucket not in rows and family.feasible(spec, config, device) is None:
                rows[bucket] = (config, source)
                rows.tuned_for[bucket] = kin.name
                if bucket in served.tuned_under:
                    rows.tuned_under[bucket] = served.tuned_under[bucket]
    if rows.tuned_under:
        tuned = ", ".join(sorted(set(rows.tuned_under.values()), key=Version))
        _warn_once(f"tilegen: {spec.name} on {device.key}: no tuned row of the installed Triton {triton_version} for "
                   f"{len(rows.tuned_under)} bucket(s); serving rows tuned under Triton {tuned} instead. "
                   f"`tilegen db verify --retime` on a GPU of this kind times them there and stores them under "
                   f"{triton_version}",
                   level=logging.INFO)
    return rows


def served_rows(files: Sequence[Sequence[TunedRow]], specs: Mapping[tuple[str, str], Spec],
                devices: Mapping[str, DeviceInfo], installed: str) -> set[tuple[int, int]]:
    """Which rows of another Triton dispatch serves under ``installed``, as ``tuned_rows`` chooses them:
    ``(file index, row index)`` of each. ``files`` are the files' rows, the one dispatch prefers first
    (the user's, then the shipped one); ``specs`` the current template's variants by (spec hash, template
    hash), so a row of any other template or of an unknown family serves nothing; ``devices`` the GPUs by key
    (each row is judged on its own GPU, as on a machine with that GPU)."""
    groups: dict[tuple, list[tuple]] = {}
    for f, rows in enumerate(files):
        for i, row in enumerate(rows):
            spec = specs.get((row.spec_hash, row.template_hash))
            order = serving_order(row.triton_version, installed)
            if spec is None or row.gpu_key not in devices or order is None:
                continue
            groups.setdefault((row.spec_hash, row.template_hash, row.gpu_key, row.bucket), []).append(
                (order, f, i, spec, row))
    served = set()
    for found in groups.values():
        for order, f, i, spec, row in sorted(found, key=lambda c: c[:3]):
            if row.triton_version == installed:
                break  # the installed Triton's own row serves the bucket
            try:
                runnable_here(spec, devices[row.gpu_key], row.config)
            except RowError:
                continue
            served.add((f, i))
            break
    return served


def _warn_once(message: str, level: int = logging.WARNING) -> None:
    if message not in _warned:
        _warned.add(message)
        log.log(level, message)
