"""kvroute.store: the persistent rank registry (SQLAlchemy 2 async; SQLite by default, PostgreSQL).

Reading path: models (schema) -> engine (per-backend connection settings, timeouts) -> faults
(database failures sorted into busy and unavailable) -> ranks and rejections (session-level
queries, no commits) -> registrations (parsed documents by generation) -> admission and
rank_writes (a batch of registrations checked against peer geometry classes and written in a fixed
number of statements) -> leases (the heartbeat: one conditional statement) -> registry (the
registration service: one transaction per call) -> snapshots (instance states for plans) ->
lease_watch (counts and expiries for operators) -> jobs (transfer-job persistence) -> migrate
(Alembic, programmatically). ``kvroute.control`` calls these with a sessionmaker from
``engine.make_sessionmaker``; ``kvroute.api`` maps ``errors`` to HTTP in one table.
"""
