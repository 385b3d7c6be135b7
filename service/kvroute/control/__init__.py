"""kvroute.control: the application services between the REST layer and the domain packages.

Reading path: registry (admission with the process's caches: parsed registrations by generation,
verdicts memoized per pair of geometry classes; heartbeats, deletions, the reaper's rounds) ->
inventory (the reads: deployments, instances, ranks, refusals, job records) -> admissions (registrations arriving together
admitted in one transaction) -> state_reads (one database read per wave of concurrent plan reads)
-> plans (plans and plan sets served from the registry, cached by generation) -> plan_answers
(each plan encoded once per format, served as bytes with its ETag) -> compatibility (the context x
generation matrix, from the memoized verdicts) -> transfers (transfer jobs: a journal of job rows,
leg resolution from plans to opened pool memory, and the facade the REST layer calls).

Dependencies point one way: ``api -> control -> {transfer, store, geometry}``, and the api reaches
the store only through here (``tests/unit/test_layering.py``). Nothing here imports
aiohttp; the data plane (torch) is imported only by ``control.transfers`` and only when the app
starts its worker pool.
"""
