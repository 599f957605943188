"""``tilegen emit``: print or write the generated source for a spec.

With ``--tuned`` the module also carries this GPU's tuned configs and its family's
entry point (``attention`` for attention forward), so it runs with torch and triton
alone, where tilegen is not installed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import triton
import typer

from tilegen import env
from tilegen.cli.app import app, fail, check_db_path, user_db
from tilegen.cli.spec_args import MOD_HELP, takes_spec, with_mods
from tilegen.codegen import source_for
from tilegen.codegen.render import template_hash
from tilegen.db import DatabaseError, TuningDB, tuned_rows
from tilegen.device import device_info
from tilegen.families import family_of
from tilegen.ir import Spec
from tilegen.triton_internals.interpreter import mend_on_import_source


#: What a module written without --tuned gets after the generated source: tilegen mends Triton's CPU interpreter
#: before it runs a module of its own, and the module written out must come out right without tilegen too.
_MEND_ON_IMPORT = """

# ---- Written by `tilegen emit` ---------------------------------------------------------------
import os


"""


@app.command()
@takes_spec
def emit(
    spec: Spec,
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Write here instead of stdout."),
    tuned: bool = typer.Option(
        False, "--tuned", help="Append this GPU's tuned configs and an entry point (attention() for attention): "
        "a standalone module that needs only torch and triton.",
    ),
    db: Optional[Path] = typer.Option(
        None, "--db", help="With --tuned: the tuning database to read (default: $TILEGEN_DB, else the user's).",
    ),
    score_mod: Optional[str] = typer.Option(None, help=MOD_HELP.format(kind="score mod")),
    mask_mod: Optional[str] = typer.Option(None, help=MOD_HELP.format(kind="mask mod")),
) -> None:
    """Print the Triton kernel and launcher generated for a spec (followed by tilegen's mend of Triton's CPU
    interpreter, applied when the module is imported under it)."""
    spec = with_mods([spec], score_mod, mask_mod)[0]
    if db is not None and not tuned:
        fail("--db: read only with --tuned")
    if output is not None:
        if output.is_dir():
            fail(f"-o: {output} is a folder; give a file name, e.g. {output / (spec.name + '.py')}")
        if not output.parent.is_dir():
            fail(f"-o: the folder {output.parent} does not exist; create it first or write elsewhere")
    if db is not None:
        check_db_path("--db", db)
    elif tuned:
        # The user's file is read as --db would be: a module is baked from it, so one that cannot be read is an
        # error naming the variable, not a warning over a table without its rows (dispatch's way, call by call).
        db = user_db()
        check_db_path("TILEGEN_DB" if os.environ.get("TILEGEN_DB") else "the user database", db)
        if not db.exists():
            db = None
    try:
        text = source_for(spec)
        text += standalone_entry_point(spec, user_db=db) if tuned else _MEND_ON_IMPORT + mend_on_import_source()
    except (NotImplementedError, DatabaseError) as e:
        fail(str(e))
    if output is None:
        typer.echo(text, nl=False)
        return
    try:
        output.write_text(text)
    except OSError as e:
        fail(f"-o: cannot write {output}: {e.strerror or e}")
    typer.echo(f"wrote {output} ({spec.name}, spec {spec.hash})", err=True)


def standalone_entry_point(spec: Spec, *, user_db: Path | None = None) -> str:
    """Python source to append to ``source_for(spec)``: the tuned table of this device and an entry point.

    Rows come from ``tuned_rows`` (``user_db`` over the shipped database) for
    ``device_info()``, this Triton (else the nearest one's, as dispatch serves them) and this
    template; the family writes the rest.
    """
    # An explicit file must exist and be readable; an empty one is a database with no rows yet, as tune takes it.
    if user_db is not None and not (user_db.is_file() and user_db.stat().st_size == 0):
        TuningDB(user_db, readonly=True).close()
    family = family_of(spec)
    device = device_info()
    template = template_hash(family)
    rows = tuned_rows(spec, device, template, triton.__version__, user_db=user_db)
    # A row served from another Triton's or another spec's says so in the module's comment beside it, as explain does.
    rows = {bucket: (config, source if rows.note(bucket) is None else f"{source} ({rows.note(bucket)})")
            for bucket, (config, source) in rows.items()}
    return family.standalone_entry_point(
        spec, rows, device, template_hash=template, triton_version=triton.__version__
    )


