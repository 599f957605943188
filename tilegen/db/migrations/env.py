"""Alembic environment for the tuning database.

tilegen runs migrations itself (``tilegen.db.migrate``) on a connection that already
holds the write lock, handed over in ``config.attributes["connection"]``; there is
no alembic.ini and no offline mode.
"""

from alembic import context

from tilegen.db.models import VERSION_TABLE, Base

context.configure(
    connection=context.config.attributes["connection"],
    target_metadata=Base.metadata,
    version_table=VERSION_TABLE,
    render_as_batch=True,  # SQLite alters tables by copying them; batch mode does that
)
with context.begin_transaction():  # a no-op: the caller's transaction commits or rolls back
    context.run_migrations()
