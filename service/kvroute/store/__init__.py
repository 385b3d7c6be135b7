"""kvroute.store: the persistent rank registry (SQLAlchemy 2 async; SQLite by default, PostgreSQL).

Reading path: models (schema) -> engine (per-backend connection settings) -> ranks and rejections
(session-level queries, no commits) -> registry (the registration service: one transaction per
call) -> jobs (transfer-job persistence) -> migrate (Alembic, programmatically). Handlers use
``registry``/``jobs`` with a sessionmaker from ``engine.make_sessionmaker`` and map
``errors.NotFound``/``errors.Conflict`` to HTTP.
"""
