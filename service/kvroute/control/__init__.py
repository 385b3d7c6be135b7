"""kvroute.control: the application services between the REST layer and the domain packages.

Reading path: plans (plans and plan sets served from the registry, cached by generation) ->
compatibility (the context x generation matrix) -> transfers (transfer jobs: a journal of job rows,
leg resolution from plans to opened pool memory, and the facade the REST layer calls).

Dependencies point one way: ``api -> control -> {transfer, store, geometry}``. Nothing here imports
aiohttp; the data plane (torch) is imported only by ``control.transfers`` and only when the app
starts its worker pool.
"""
