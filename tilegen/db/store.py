"""``TuningDB``: tuned configs and every trial behind them, in one SQLite file or a PostgreSQL database.

Example::

    >>> from tilegen import AttentionSpec
    >>> from tilegen.device import CPU_INTERPRETER
    >>> from tilegen.key import TuningKey
    >>> key = TuningKey.current(AttentionSpec(head_dim=64), CPU_INTERPRETER).variant_fields()
    >>> with TuningDB("tuning.sqlite") as db:  # doctest: +SKIP
    ...     db.record_best(**key, bucket=1024, config={"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 1},
    ...                    time_ms=0.41, max_error=2e-3, trials=40)
    ...     db.best(**key)[1024].time_ms
    True
    0.41
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import json
import math
import os
import stat
from datetime import datetime
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
import triton
from sqlalchemy import ColumnElement, Select, and_, delete, func, or_, select, text, true, type_coerce
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session
from sqlalchemy.types import NullType

from tilegen import env
from tilegen.version import __version__
from tilegen.codegen.render import template_hash as current_template_hash
from tilegen.db.errors import DatabaseError
from tilegen.db.exchange import (
    FORMAT, FORMAT_VERSION, SECTIONS, check, imported_study, jsonable_number, measured_study,
)
from tilegen.db.location import is_url, refuse_file_uri, server_url, shown
from tilegen.db.sqlite import refuse_special
from tilegen.db.validate import (
    RowError, check_best, check_gpu, check_stored_trial, check_stored_tuned, check_trial, check_variant,
    config_from_json,
)
from tilegen.db.migrate import (
    ADVISORY_CLASS, CONNECT_TIMEOUT_S, WRITE, advisory_key, explain_error, explain_server_error, open_engine,
    open_server_engine, studies_connection,
)
from tilegen.db.models import (
    TRIAL_STATUSES,
    VERSION_TABLE,
    Base,
    Gpu,
    Trial,
    TunedConfig,
    Variant,
    utcnow,
)
from tilegen.db.rows import TrialRow, TunedRow, VariantRow
from tilegen.device import DeviceInfo
from tilegen.families import families
from tilegen.ir import Spec

__all__ = ["Refused", "TuningDB", "studies_path", "studies_url"]

_M = TypeVar("_M", bound=Base)
#: How long a write to the studies file waits while another tune process writes.
_STUDIES_TIMEOUT_S = 60


def studies_url(db_path: str | os.PathLike[str]) -> str:
    """Optuna storage URL of the studies kept beside a tuning database: ``<stem>.optuna.sqlite``.

    >>> studies_url("/data/tuning.sqlite")
    'sqlite:////data/tuning.optuna.sqlite'
    """
    return f"sqlite:///{studies_path(db_path)}"


def studies_path(db_path: str | os.PathLike[str]) -> Path:
    """The file of the studies kept beside a tuning database (``studies_url``'s)."""
    path = Path(db_path).expanduser().absolute()
    return path.with_name(path.stem + ".optuna.sqlite")


@dataclasses.dataclass(frozen=True)
class Refused:
    """A stored row a read left out: its kind ("tuned", "trial", "variant", "gpu"), id, why (``reason``;
    ``line``, which ``str`` gives, names the row and the file too) and its values as read (unchecked:
    print them through ``safe_text`` only)."""

    kind: str
    id: Any
    reason: str
    line: str
    raw: dict[str, Any]

    def __str__(self) -> str:
        return self.line


class TuningDB:
    """One tuning database; safe to share between threads and between processes (and hosts, on a server).

    ``path`` is a SQLite file or a ``postgresql+psycopg://`` URL; ``None`` opens
    ``tilegen.env.db_target()``. A writable open creates the file and its folder (a server's
    database must exist) and upgrades the schema; ``readonly=True`` never writes (the shipped
    database). Every failure to open, read or write raises ``DatabaseError`` naming the file
    or the server (its password hidden). ``location`` is that name; ``path`` is the file,
    ``None`` on a server.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, readonly: bool = False):
        target = path if path is not None else env.db_target()
        self.readonly = readonly
        self.skipped: list[str] = []  # rows the last import_json(skip_bad=True) left out, each named
        # Stored rows the readers left out, each named with why (``tilegen.db.validate``); see ``take_refused``.
        self._refused: dict[tuple[str, Any], Refused] = {}
        if is_url(target):
            self.path = None
            self.url = server_url(target)
            self.location = shown(self.url)
            self._engine = open_server_engine(self.url, self.location, readonly=readonly)
            self._writer = self._engine
            return
        refuse_file_uri(target)
        self.path = Path(target).expanduser()
        self.url = None
        self.location = str(self.path)
        # Its stat, not is_file, which raises OSError for a path it cannot look up.
        found = refuse_special(self.path)
        if readonly and (found is None or not stat.S_ISREG(found.st_mode)):
            raise DatabaseError(f"no tilegen database at {self.path}")
        if not readonly:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise DatabaseError(f"cannot create the tilegen database {self.path}: {e.strerror or e}") from e
        self._engine = open_engine(self.path, readonly=readonly)
        self._writer = self._engine.execution_options(**WRITE)

    def __repr__(self) -> str:
        return f"TuningDB({self.location!r}{', readonly=True' if self.readonly else ''})"

    @property
    def is_server(self) -> bool:
        return self.url is not None

    def take_refused(self) -> list[Refused]:
        """The stored rows that reads since the last call left out, each saying why (``str``, one line); a
        shared or edited file can hold rows no writer would store, and no reader uses them."""
        refused, self._refused = list(self._refused.values()), {}
        return refused

    def delete_refused(self, refused: Refused) -> int:
        """Delete a row a read refused (``take_refused``); returns 1, or 0 if gone."""
        model = {"tuned": TunedConfig, "trial": Trial, "variant": Variant, "gpu": Gpu}[refused.kind]
        with self._session(write=True) as session:
            return _delete(session, model, model.id == refused.id)

    def studies_url(self) -> str:
        """Optuna's storage URL for the studies: the file beside a SQLite database, the same server database."""
        if self.is_server:
            return self.url.render_as_string(hide_password=False)
        return studies_url(self.path)

    def studies_engine(self) -> dict[str, Any]:
        """SQLAlchemy engine options for Optuna's storage at ``studies_url``: a server's connections
        checked before use and bounded in time; a file's in WAL mode, waiting up to a minute while
        another tune process writes."""
        if self.is_server:
            return {"pool_pre_ping": True, "connect_args": {"connect_timeout": CONNECT_TIMEOUT_S}}
        return {"creator": functools.partial(studies_connection, str(studies_path(self.path)), _STUDIES_TIMEOUT_S)}

    @contextlib.contextmanager
    def studies_lock(self, name: str = "") -> Iterator[None]:
        """Hold, across processes (and hosts, on a server), the lock on Optuna's studies named ``name``.

        Optuna creates its tables and studies with check-then-create, and a tune decides which
        study (``<key>-run<k>``) to add to from what the database holds: both must be one step
        for every process. A file lock beside a SQLite database (one host shares it); a
        session advisory lock on a server, held on a connection of its own.
        """
        if not self.is_server:
            lock = Path(f"{studies_path(self.path)}.lock")
            try:
                lock.parent.mkdir(parents=True, exist_ok=True)
                f = open(lock, "a")
            except OSError as e:  # another user's lock file, say: the tune cannot share the studies
                raise DatabaseError(f"cannot open the lock of the Optuna studies {lock}: {e.strerror or e}") from e
            with f:
                fcntl.flock(f, fcntl.LOCK_EX)
                yield
            return
        key = (ADVISORY_CLASS, advisory_key("studies:" + name))
        try:
            connection = self._engine.connect()
            connection.exec_driver_sql("SELECT pg_advisory_lock(%s, %s)", key)
        except SQLAlchemyError as e:
            raise explain_server_error(e, self.location, False) from e
        try:
            yield
        finally:
            with contextlib.suppress(SQLAlchemyError):
                connection.exec_driver_sql("SELECT pg_advisory_unlock(%s, %s)", key)
            connection.close()

    def check_writable(self) -> None:
        """Raise ``DatabaseError`` unless this database can be written now (a tune asks before it measures).

        SQLite opens a read-only file without complaint and fails only at the first write, so
        the permissions are asked first and then a write that changes nothing is made. A
        server gets that write alone: it answers for its own permissions.
        """
        if self.is_server:
            with self._session(write=True) as session:
                session.execute(text(f"UPDATE {VERSION_TABLE} SET version_num = version_num"))
            return
        where = self.path if self.path.exists() else self.path.parent
        if self.readonly or not os.access(where, os.W_OK) or not os.access(self.path.parent, os.W_OK):
            raise DatabaseError(
                f"cannot write the tilegen database {self.path}: it is read-only here; "
                f"give --db (or TILEGEN_DB) a file you can write"
            )
        with self._session(write=True) as session:
            version = session.execute(text("PRAGMA user_version")).scalar()
            session.execute(text(f"PRAGMA user_version = {int(version)}"))

    def __enter__(self) -> TuningDB:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the connections; a writable SQLite file first gets its write-ahead log copied in.

        Until that checkpoint the rows written live in ``<file>-wal`` beside the file. SQLite
        checkpoints when the last connection to a file closes, which a tune does not wait for
        (its processes leave through ``os._exit``), so a tuned file copied alone, as one ships
        a database, held none of the tune's rows."""
        if not self.is_server and not self.readonly:
            with contextlib.suppress(SQLAlchemyError), self._engine.connect() as connection:
                connection.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
        self._engine.dispose()

    # -- writing -------------------------------------------------------------------------

    def record_trial(
        self, *, spec: Spec, device: DeviceInfo, template_hash: str, triton_version: str, bucket: int,
        study_name: str, trial_number: int, config: dict[str, Any], status: str,
        time_ms: float | None = None, max_error: float | None = None, reason: str | None = None,
    ) -> None:
        """Store one trial's outcome.

        Recording ``(study_name, trial_number)`` again with the same config updates that trial
        (a retried write); with another config it raises ``DatabaseError``: a trial of another
        run under that number is never overwritten. A trial that fails ``check_trial`` (an "ok"
        with a config the kernel cannot run, or a time that is not positive) raises ``RowError``.
        """
        if status not in TRIAL_STATUSES:
            raise ValueError(f"status: expected one of {', '.join(TRIAL_STATUSES)}, got {status!r}")
        check_trial(spec, device, bucket, config, status, time_ms, max_error=max_error, trial_number=trial_number,
                    study_name=study_name, triton_version=triton_version)
        # SQLite stores NaN as NULL; a server would keep it, and exports (JSON) refuse it.
        time_ms, max_error = (None if isinstance(v, float) and math.isnan(v) else v for v in (time_ms, max_error))
        with self._session(write=True) as session:
            values = dict(
                **_ids(session, spec, device, template_hash), bucket=bucket, triton_version=triton_version,
                config_json=_canonical(config), status=status, time_ms=time_ms, max_error=max_error,
                reason=reason, created_at=utcnow(), provenance="tuned",
            )
            key = {"study_name": study_name, "trial_number": trial_number}
            row, created = _insert_or_fetch(session, Trial, key, values)
            if not created:
                if row.config_json != values["config_json"] or row.variant_id != values["variant_id"]:
                    raise DatabaseError(
                        f"{self.location} already holds trial {trial_number} of study {study_name} with another config; "
                        f"trials are never overwritten (start a new study for this key)"
                    )
                for name, value in values.items():
                    setattr(row, name, value)

    def trials_in_studies(self, study_prefix: str) -> list[TrialRow]:
        """Every trial filed under a study whose name is ``study_prefix`` or starts with it."""
        with self._session() as session:
            return self._trials(session, Trial.study_name.startswith(study_prefix, autoescape=True))

    def trial_numbers(self, study_prefix: str) -> dict[str, int]:
        """The largest trial number stored per study whose name is ``study_prefix`` or starts with it."""
        query = (
            select(Trial.study_name, func.max(Trial.trial_number))
            .where(Trial.study_name.startswith(study_prefix, autoescape=True))
            .group_by(Trial.study_name)
        )
        with self._session() as session:
            return {name: number for name, number in session.execute(query)}

    def record_best(
        self, *, spec: Spec, device: DeviceInfo, template_hash: str, triton_version: str, bucket: int,
        config: dict[str, Any], time_ms: float, max_error: float, trials: int,
        tflops: float | None = None, gbps: float | None = None, replace: bool = False,
    ) -> bool:
        """Keep the faster of the stored row and this one; ``True`` when this one was stored.
        ``replace`` stores this one whatever the stored time: a tune's confirmed winner, timed
        again alternately with its closest rivals on one GPU, against one first measurement.

        The trial count only grows (the larger of the two), whichever row wins. A row the
        family's kernel cannot run on ``device``, or with a time that is not positive and
        finite, or a bucket its family's rule never gives, raises ``RowError``.
        """
        versions = dict(triton_version=triton_version, torch_version=torch.__version__, tilegen_version=__version__)
        check_best(spec, device, bucket, config, time_ms, max_error, trials, tflops=tflops, gbps=gbps, versions=versions)
        with self._session(write=True) as session:
            key = dict(**_ids(session, spec, device, template_hash), bucket=bucket, triton_version=triton_version)
            values = dict(
                torch_version=torch.__version__, tilegen_version=__version__,
                config_json=_canonical(config), time_ms=time_ms, tflops=tflops, gbps=gbps,
                max_error=max_error, trials=trials, created_at=utcnow(), provenance="tuned",
            )
            return _merge_best(session, key, values, replace=replace)

    def import_json(
        self, data: dict[str, Any], *, skip_bad: bool = False, provenance: str = "imported", replace: bool = False,
    ) -> int:
        """Merge an export (``export_json``) in; returns how many tuned rows and trials it added or improved.

        Tuned rows merge as ``record_best`` does; trials already here are kept as they are. An imported trial
        is filed under its study's name with ``IMPORTED`` after it (``imported_study``), never in the study
        itself: a tune of that study running now numbers its trials as Optuna hands the numbers out, and an
        import that took one of them had its next write refused (the tune ended, its trial lost). A trial the
        study or its imported twin already holds (the same config, status and time) is not added again; one
        whose number the imported study holds for another measurement (a study run again elsewhere) is added
        after its last. With ``replace`` the export's rows win whatever their times (their trial counts too; of
        its own rows for one key, the fastest), and each study it holds trials of loses the trials stored here
        first, its own and those imported: a re-tune whose times are not comparable with the stored ones
        (measured another way) replaces them, rows and trials alike.
        Every row is marked with ``provenance`` ("imported", or "pulled" from a server). A malformed document raises ``ValueError``
        before anything is written, as does a row that fails ``tilegen.db.validate`` (a config
        its kernel cannot run, a time that is not positive, a bucket its family never gives),
        naming it; with ``skip_bad`` such rows are left out instead (``self.skipped`` says which).
        """
        sections = check(data, skip_bad=skip_bad)
        self.skipped = sections.pop("skipped")
        changed = 0
        with self._session(write=True) as session:
            gpu_ids = {g["key"]: _gpu_id(session, g) for g in sections["gpus"]}
            variant_ids = {
                (v["spec_hash"], v["template_hash"]): _variant_id(session, **v) for v in sections["variants"]
            }
            for entry in _fastest_per_key(sections["tuned"]) if replace else sections["tuned"]:
                ids = _entry_ids(entry, gpu_ids, variant_ids)
                key = dict(**ids, bucket=entry["bucket"], triton_version=entry["triton_version"])
                values = {n: entry[n] for n in ("torch_version", "tilegen_version", "time_ms", "tflops", "gbps",
                                                "max_error", "trials", "created_at")}
                values.update(config_json=_canonical(entry["config"]), provenance=provenance)
                changed += _merge_best(session, key, values, replace=replace, recount=replace)
            if replace:
                named = {entry["study_name"] for entry in sections["trials"]}
                studies = {name for study in named for name in (measured_study(study), imported_study(study))}
                if studies:
                    _delete(session, Trial, Trial.study_name.in_(studies))
            for entry in sections["trials"]:
                key = {"study_name": imported_study(entry["study_name"]), "trial_number": entry["trial_number"]}
                values = {n: entry[n] for n in ("bucket", "triton_version", "status", "time_ms", "max_error",
                                                "reason", "created_at")}
                values.update(_entry_ids(entry, gpu_ids, variant_ids), config_json=_canonical(entry["config"]),
                              provenance=provenance)
                measured = {"study_name": measured_study(entry["study_name"]), "trial_number": entry["trial_number"]}
                if _same_trial(session, measured, values) or any(
                        _twin(session, {"study_name": name}, values) is not None
                        for name in (measured["study_name"], key["study_name"])):
                    continue  # here already: measured here (an export of this database coming back), or imported
                added = _insert_or_fetch(session, Trial, key, values)[1]
                if not added and _twin(session, key, values) is None:
                    # The study was run again elsewhere, numbering from 0 (a re-tune into a fresh file): its
                    # trials go after the imported study's last instead of being dropped for the numbers they share.
                    last = session.scalar(select(func.max(Trial.trial_number)).where(
                        Trial.study_name == key["study_name"]))
                    added = _insert_or_fetch(session, Trial, {**key, "trial_number": last + 1}, values)[1]
                changed += added
        return changed

    def prune(
        self, *, keep_triton: str | None = None, keep_templates: Iterable[str] | None = None,
        keep_tilegen: str | None = None, all_families: bool = False, dry_run: bool = False,
    ) -> Any:
        """Delete rows that dispatch can never read again; returns how many tuned rows and trials went.

        With ``dry_run`` nothing is deleted and the answer is ``(tuned rows, trial count)``
        that a prune with these arguments would delete.

        Dispatch keys on the Triton version and the template hash, so a tuned row or trial of a
        registered family is stale when its Triton version is not ``keep_triton`` (default: the
        installed Triton) or its variant's template hash is not in ``keep_templates`` (default:
        each registered family's current template). Rows of families this tilegen does not
        know (a newer release wrote them) are kept, unless ``all_families``: then they count as
        stale too. The tilegen version is not part of the key, so rows tuned by another tilegen
        release stay unless ``keep_tilegen`` names the one to keep (trials carry no tilegen
        version and are kept then). Variants and GPUs left without rows go too. Versions
        compare exactly: "3.6" keeps no row of "3.6.0" (the CLI refuses a version no row has).
        """
        with self._session(write=not dry_run) as session:
            tuned, trials = self._stale(keep_triton, keep_templates, keep_tilegen, all_families)
            if dry_run:
                rows = self._tuned_rows(session, tuned)
                return rows, _count(session, Trial, trials)
            removed = _delete(session, TunedConfig, tuned) + _delete(session, Trial, trials)
            for model, column in ((Variant, "variant_id"), (Gpu, "gpu_id")):
                in_use = or_(*(model.id.in_(select(getattr(table, column))) for table in (TunedConfig, Trial)))
                _delete(session, model, ~in_use)
        return removed

    def delete_tuned(self, row: TunedRow) -> int:
        """Delete one tuned row (its variant, GPU, Triton version and bucket); returns 1, or 0 if gone."""
        with self._session(write=True) as session:
            variant = select(Variant.id).where(
                Variant.spec_hash == row.spec_hash, Variant.template_hash == row.template_hash)
            gpu = select(Gpu.id).where(Gpu.key == row.gpu_key)
            return _delete(session, TunedConfig, and_(
                TunedConfig.variant_id.in_(variant), TunedConfig.gpu_id.in_(gpu),
                TunedConfig.triton_version == row.triton_version, TunedConfig.bucket == row.bucket,
            ))

    def versions(self) -> tuple[set[str], set[str]]:
        """The Triton versions and the tilegen versions the file's tuned rows and trials name."""
        with self._session() as session:
            tritons = set(session.scalars(select(TunedConfig.triton_version).distinct()))
            tritons |= set(session.scalars(select(Trial.triton_version).distinct()))
            tilegens = set(session.scalars(select(TunedConfig.tilegen_version).distinct()))
        return tritons, tilegens

    @staticmethod
    def _stale(keep_triton, keep_templates, keep_tilegen, all_families):
        """Where-clauses of the stale tuned rows and trials (see ``prune``)."""
        triton_version = keep_triton or triton.__version__
        templates = _current_templates()
        if keep_templates is not None:
            current = Variant.template_hash.in_(sorted(keep_templates))
        else:
            current = or_(*(and_(Variant.family == name, Variant.template_hash == template)
                            for name, template in templates.items()))
        judged = true() if all_families else Variant.family.in_(list(templates))
        judged_variants = select(Variant.id).where(judged)
        stale_variants = select(Variant.id).where(judged, ~current)
        stale_tuned = [TunedConfig.triton_version != triton_version, TunedConfig.variant_id.in_(stale_variants)]
        if keep_tilegen is not None:
            stale_tuned.append(TunedConfig.tilegen_version != keep_tilegen)
        judged_tuned = TunedConfig.variant_id.in_(judged_variants)
        stale_trials = or_(Trial.triton_version != triton_version, Trial.variant_id.in_(stale_variants))
        return and_(judged_tuned, or_(*stale_tuned)), and_(Trial.variant_id.in_(judged_variants), stale_trials)

    @staticmethod
    def why_stale(rows: Iterable[TunedRow]) -> list[str | None]:
        """Why dispatch here does not read each tuned row as its installed Triton's, in a few words, as
        ``prune`` judges by default (the installed Triton, each registered family's current template);
        ``None`` for a row it reads. Rows of a family this tilegen does not know (which ``prune`` keeps
        unless told) are ``"unknown family"``. An ``"other Triton"`` row may still be served for want
        of the installed Triton's (``tilegen.db.lookup.served_rows`` says which)."""
        current = _current_templates()

        def why(row: TunedRow) -> str | None:
            if row.family not in current:
                return "unknown family"
            if row.template_hash != current[row.family]:
                return "template changed"
            if row.triton_version != triton.__version__:
                return "other Triton"
            return None

        return [why(row) for row in rows]

    # -- reading -------------------------------------------------------------------------

    def best(
        self, *, spec: Spec, device: DeviceInfo, template_hash: str, triton_version: str
    ) -> dict[int, TunedRow]:
        """The tuned rows of one variant on one GPU and Triton, by bucket."""
        where = and_(Variant.spec_hash == spec.hash, Variant.template_hash == template_hash,
                     Gpu.key == device.key, TunedConfig.triton_version == triton_version)
        with self._session() as session:
            return {row.bucket: row for row in self._tuned_rows(session, where)}

    def list_tuned(self) -> list[TunedRow]:
        """Every tuned row, by variant name, spec, GPU, Triton version and bucket."""
        with self._session() as session:
            return self._tuned_rows(session)

    def variants(self, prefix: str = "") -> list[VariantRow]:
        """Variants whose spec hash starts with ``prefix``, by spec hash and template hash."""
        with self._session() as session:
            return self._variants(session, prefix)

    def gpus(self) -> list[dict[str, Any]]:
        """Every GPU entry (``key``, ``name``, ``capability``, ``sm_count``, ``memory_bytes``), by key."""
        with self._session() as session:
            return self._read(session, _raw_query(_GPU_COLUMNS).order_by(Gpu.key), _gpu_entry)

    def trials_for(self, spec_hash: str) -> list[TrialRow]:
        """Every trial of a spec (all template versions, GPUs and Tritons), by study and trial number."""
        with self._session() as session:
            return self._trials(session, Variant.spec_hash == spec_hash)

    def export_json(
        self, *, gpu_key: str | None = None, triton_version: str | None = None, tilegen_version: str | None = None,
    ) -> dict[str, Any]:
        """The database in the JSON form ``import_json`` reads (see ``tilegen.db.exchange``).

        Without arguments, all of it. ``gpu_key``, ``triton_version`` and ``tilegen_version``
        keep only the tuned rows of that GPU, Triton and tilegen release (``tilegen db pull``),
        with the trials of their variants on that GPU and Triton (trials carry no tilegen
        version), and the GPUs and variants those name.
        """
        tuned_where, trial_where = [], []
        if gpu_key is not None:
            tuned_where.append(Gpu.key == gpu_key)
            trial_where.append(Gpu.key == gpu_key)
        if triton_version is not None:
            tuned_where.append(TunedConfig.triton_version == triton_version)
            trial_where.append(Trial.triton_version == triton_version)
        if tilegen_version is not None:
            tuned_where.append(TunedConfig.tilegen_version == tilegen_version)
        whole = not tuned_where
        with self._session() as session:  # one transaction: a consistent snapshot under concurrent writers
            tuned = self._tuned_rows(session, and_(true(), *tuned_where))
            if whole:
                trials = self._trials(session, true())
            else:
                pulled = {(row.spec_hash, row.template_hash) for row in tuned}
                trials = [row for row in self._trials(session, and_(true(), *trial_where))
                          if (row.spec_hash, row.template_hash) in pulled]
            gpus = self._read(session, _raw_query(_GPU_COLUMNS).order_by(Gpu.key), _gpu_entry)
            variants = [dataclasses.asdict(v) for v in self._variants(session, "")]
        if not whole:
            named = {row.gpu_key for row in [*tuned, *trials]}
            gpus = [g for g in gpus if g["key"] in named]
            named_variants = {(row.spec_hash, row.template_hash) for row in [*tuned, *trials]}
            variants = [v for v in variants if (v["spec_hash"], v["template_hash"]) in named_variants]
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "gpus": gpus,
            "variants": variants,
            "tuned": [_jsonable(row) for row in tuned],
            "trials": [_jsonable(row) for row in trials],
        }

    # -- plumbing ------------------------------------------------------------------------

    def _read(self, session: Session, query: Select, make: Any) -> list[Any]:
        """``make`` of each row ``query`` reads (raw values, see ``_raw_query``); a row it refuses
        (``RowError``) is left out and kept for ``take_refused``."""
        kept = []
        for raw in session.execute(query).mappings():
            try:
                kept.append(make(raw))
            except RowError as e:
                kind = raw.get("what", "gpu")
                line = f"{kind} row {raw['id']} of {self.location}: {e}"
                self._refused[kind, raw["id"]] = Refused(kind, raw["id"], str(e), line, dict(raw))
        return kept

    def _tuned_rows(self, session: Session, where: ColumnElement[bool] | None = None) -> list[TunedRow]:
        query = _raw_query(_TUNED_COLUMNS, "tuned").where(true() if where is None else where).order_by(
            Variant.name, Variant.spec_hash, Gpu.key, TunedConfig.triton_version, TunedConfig.bucket)
        return self._read(session, query, _tuned_row)

    def _trials(self, session: Session, where: ColumnElement[bool]) -> list[TrialRow]:
        query = _raw_query(_TRIAL_COLUMNS, "trial").where(where).order_by(Trial.study_name, Trial.trial_number)
        return self._read(session, query, _trial_row)

    def _variants(self, session: Session, prefix: str) -> list[VariantRow]:
        query = (_raw_query(_VARIANT_COLUMNS, "variant")
                 .where(Variant.spec_hash.startswith(prefix, autoescape=True))
                 .order_by(Variant.spec_hash, Variant.template_hash))
        return self._read(session, query, _variant_row)

    @contextlib.contextmanager
    def _session(self, *, write: bool = False) -> Iterator[Session]:
        """One transaction: committed on success, rolled back on any error."""
        if write and self.readonly:
            raise DatabaseError(f"{self.location} is open read-only")
        try:
            with Session(self._writer if write else self._engine, expire_on_commit=False) as session, session.begin():
                yield session
        except SQLAlchemyError as e:
            if self.is_server:
                raise explain_server_error(e, self.location, self.readonly) from e
            raise explain_error(e, self.path, self.readonly) from e


def _insert_or_fetch(
    session: Session, model: type[_M], key: dict[str, Any], values: dict[str, Any]
) -> tuple[_M, bool]:
    """The row with unique ``key``, inserted with ``values`` when absent; ``True`` when inserted.

    The row comes locked (``FOR UPDATE``, which SQLite's dialect leaves out: there ``BEGIN
    IMMEDIATE`` already holds the whole file), so on a server two writers merging into one
    tuned row take turns instead of the slower overwriting the faster.
    """
    query = select(model).filter_by(**key).with_for_update()
    row = session.scalars(query).one_or_none()
    if row is not None:
        return row, False
    row = model(**{**values, **key})
    try:
        with session.begin_nested():
            session.add(row)
    except IntegrityError:
        # Another writer stored the key between our read and our insert. BEGIN IMMEDIATE rules
        # that out among tilegen processes on SQLite; on a server (no predicate locks) and for
        # a writer that does not lock first, it happens.
        return session.scalars(query).one(), False
    return row, True


def _same_trial(session: Session, key: dict[str, Any], values: dict[str, Any]) -> bool:
    """Whether the study holds the trial of the key's number with the same config: the same trial, though a tune
    may have timed it again since (confirming its bucket's winner) and an export still carries the first time."""
    row = session.scalar(select(Trial).where(Trial.study_name == key["study_name"],
                                             Trial.trial_number == key["trial_number"]))
    return row is not None and row.config_json == values["config_json"]


def _twin(session: Session, key: dict[str, Any], values: dict[str, Any]) -> Trial | None:
    """A trial of the study with the same measurement: the stored one under the key's number, or one the import
    renumbered before."""
    time = Trial.time_ms.is_(None) if values["time_ms"] is None else Trial.time_ms == values["time_ms"]
    return session.scalars(select(Trial).where(
        Trial.study_name == key["study_name"], Trial.config_json == values["config_json"],
        Trial.status == values["status"], time)).first()


def _merge_best(session: Session, key: dict[str, Any], values: dict[str, Any], replace: bool = False,
                recount: bool = False) -> bool:
    """``recount``: the row's trial count is ``values``' (its studies replace the stored ones), not the larger."""
    row, created = _insert_or_fetch(session, TunedConfig, key, values)
    if created:
        return True
    trials = values["trials"] if recount else max(row.trials, values["trials"])
    faster = replace or values["time_ms"] < row.time_ms
    if faster:
        for name, value in values.items():
            setattr(row, name, value)
    row.trials = trials
    return faster


def _variant_id(session: Session, *, spec_hash: str, template_hash: str, **values: Any) -> int:
    key = {"spec_hash": spec_hash, "template_hash": template_hash}
    return _insert_or_fetch(session, Variant, key, values)[0].id


def _ids(session: Session, spec: Spec, device: DeviceInfo, template_hash: str) -> dict[str, int]:
    gpu = dict(
        name=device.name, capability=f"{device.capability[0]}.{device.capability[1]}",
        sm_count=device.sm_count, memory_bytes=device.memory_bytes,
    )
    variant = dict(family=spec.family, name=spec.name, spec_json=spec.to_json())
    # What a reader would refuse is not written: a GPU whose name holds characters outside the safe set, say.
    check_gpu({"key": device.key, **gpu})
    check_variant(spec.family, spec.hash, template_hash, spec.name, variant["spec_json"])
    return {
        "variant_id": _variant_id(session, spec_hash=spec.hash, template_hash=template_hash, **variant),
        "gpu_id": _insert_or_fetch(session, Gpu, {"key": device.key}, gpu)[0].id,
    }


def _gpu_id(session: Session, gpu: dict[str, Any]) -> int:
    """The id of an imported GPU entry, added when its key is new; a key stored with another capability or
    SM count is refused, so an entry cannot change what a GPU's rows were checked against."""
    row = _insert_or_fetch(session, Gpu, {"key": gpu["key"]}, gpu)[0]
    for field in ("capability", "sm_count"):
        if getattr(row, field) != gpu[field]:
            raise ValueError(f"refused tilegen export: gpus: {gpu['key']} has {field} {getattr(row, field)!r} here, "
                             f"the file claims {gpu[field]!r}")
    return row.id


def _fastest_per_key(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The fastest of an export's rows for each key, in their first order: with ``replace`` the file's rows win over
    the stored ones, so without this the last of a key's rows (of two exports joined, say) would, whatever its
    time."""
    fastest: dict[tuple, dict[str, Any]] = {}
    for entry in entries:
        key = (entry["gpu_key"], entry["spec_hash"], entry["template_hash"], entry["bucket"], entry["triton_version"])
        if key not in fastest or entry["time_ms"] < fastest[key]["time_ms"]:
            fastest[key] = entry
    return list(fastest.values())


def _entry_ids(
    entry: dict[str, Any], gpu_ids: dict[str, int], variant_ids: dict[tuple[str, str], int]
) -> dict[str, int]:
    """Row ids of an export entry's variant and GPU, in the database it is imported into."""
    return {"variant_id": variant_ids[entry["spec_hash"], entry["template_hash"]], "gpu_id": gpu_ids[entry["gpu_key"]]}


def _count(session: Session, model: type[Base], where: ColumnElement[bool]) -> int:
    return session.scalar(select(func.count()).select_from(model).where(where))


def _delete(session: Session, model: type[Base], where: ColumnElement[bool]) -> int:
    result = session.execute(delete(model).where(where), execution_options={"synchronize_session": False})
    return result.rowcount


def _current_templates() -> dict[str, str]:
    """Each registered family's current template hash, by family name: what dispatch keys on,
    so what ``prune`` and ``why_stale`` judge rows by."""
    return {family.name: current_template_hash(family) for family in families()}


#: The columns a reader takes, by the names the row views use. Each is read raw (``_raw_query``):
#: SQLite lets a column hold any type, so the values are checked here (``tilegen.db.validate``),
#: not converted by SQLAlchemy, whose conversion of a bad date raises in the middle of a read.
_GPU_COLUMNS = {"id": Gpu.id, "key": Gpu.key, "name": Gpu.name, "capability": Gpu.capability,
                "sm_count": Gpu.sm_count, "memory_bytes": Gpu.memory_bytes}
_VARIANT_COLUMNS = {"id": Variant.id, "spec_hash": Variant.spec_hash, "template_hash": Variant.template_hash,
                    "family": Variant.family, "name": Variant.name, "spec_json": Variant.spec_json}
_JOINED = {**{f"gpu_{n}": c for n, c in _GPU_COLUMNS.items() if n != "id"},
           **{f"variant_{n}": c for n, c in _VARIANT_COLUMNS.items() if n != "id"}}
_TUNED_COLUMNS = {**_JOINED, **{n: getattr(TunedConfig, n) for n in (
    "id", "bucket", "triton_version", "torch_version", "tilegen_version", "config_json", "time_ms", "tflops", "gbps",
    "max_error", "trials", "created_at", "provenance")}}
_TRIAL_COLUMNS = {**_JOINED, **{n: getattr(Trial, n) for n in (
    "id", "bucket", "triton_version", "study_name", "trial_number", "config_json", "status", "time_ms", "max_error",
    "reason", "created_at", "provenance")}}


def _raw_query(columns: dict[str, Any], what: str | None = None) -> Select:
    """The columns, unconverted, labelled by name (and ``what``: the kind of row, for messages), joined
    to their variant and GPU."""
    selected = [type_coerce(column, NullType()).label(name) for name, column in columns.items()]
    if what is not None:
        selected.append(type_coerce(text(f"'{what}'"), NullType()).label("what"))
    query = select(*selected)
    if what == "tuned":
        query = query.select_from(TunedConfig).join(Variant, TunedConfig.variant_id == Variant.id).join(
            Gpu, TunedConfig.gpu_id == Gpu.id)
    elif what == "trial":
        query = query.select_from(Trial).join(Variant, Trial.variant_id == Variant.id).join(Gpu, Trial.gpu_id == Gpu.id)
    return query


def _gpu_entry(raw: Any) -> dict[str, Any]:
    entry = {n: raw[n] for n in SECTIONS["gpus"]}
    check_gpu(entry)
    return entry


def _variant_row(raw: Any) -> VariantRow:
    check_variant(raw["family"], raw["spec_hash"], raw["template_hash"], raw["name"], raw["spec_json"])
    return VariantRow(raw["spec_hash"], raw["template_hash"], raw["family"], raw["name"], raw["spec_json"])


def _joined(raw: Any) -> tuple[dict[str, Any], str]:
    """The row's GPU entry and its variant's spec JSON."""
    return {n: raw[f"gpu_{n}"] for n in SECTIONS["gpus"]}, raw["variant_spec_json"]


def _date(value: Any) -> Any:
    """A stored date: SQLite keeps text, a server a datetime; anything else stays as it is, for the check to refuse."""
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value)
        except ValueError:
            pass
    return value


def _tuned_row(raw: Any) -> TunedRow:
    row = TunedRow(
        spec_hash=raw["variant_spec_hash"], template_hash=raw["variant_template_hash"], family=raw["variant_family"],
        variant_name=raw["variant_name"], gpu_key=raw["gpu_key"], bucket=raw["bucket"],
        triton_version=raw["triton_version"], torch_version=raw["torch_version"],
        tilegen_version=raw["tilegen_version"], config=config_from_json(raw["config_json"]), time_ms=raw["time_ms"],
        tflops=raw["tflops"], gbps=raw["gbps"], max_error=raw["max_error"], trials=raw["trials"],
        created_at=_date(raw["created_at"]), provenance=raw["provenance"],
    )
    gpu, spec_json = _joined(raw)
    check_stored_tuned(row, spec_json, gpu)
    return row


def _trial_row(raw: Any) -> TrialRow:
    row = TrialRow(
        spec_hash=raw["variant_spec_hash"], template_hash=raw["variant_template_hash"], family=raw["variant_family"],
        gpu_key=raw["gpu_key"], bucket=raw["bucket"], triton_version=raw["triton_version"],
        study_name=raw["study_name"], trial_number=raw["trial_number"], config=config_from_json(raw["config_json"]),
        status=raw["status"], time_ms=raw["time_ms"], max_error=raw["max_error"], reason=raw["reason"],
        created_at=_date(raw["created_at"]), provenance=raw["provenance"],
    )
    gpu, spec_json = _joined(raw)
    check_stored_trial(row, spec_json, gpu, raw["variant_name"])
    return row


def _jsonable(row: TunedRow | TrialRow) -> dict[str, Any]:
    entry = {name: jsonable_number(value) for name, value in dataclasses.asdict(row).items()}
    return dict(entry, created_at=row.created_at.isoformat())


def _canonical(config: dict[str, Any]) -> str:
    return json.dumps(config, sort_keys=True, separators=(",", ":"))

