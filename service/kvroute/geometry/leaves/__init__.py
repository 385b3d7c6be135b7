"""geometry.leaves: what every other layer reads, importing no other geometry module.

Reading path:
- errors: GeometryError, the one refusal every check raises (code, field, both values, stage)
- limits: every bound of a registration document, which the parser checks and the spec states
- parts: roles, view kinds and owners, pools, views and interiors (what a registration is made of)
- heads: which KV heads a TP rank holds (rule 1), and the head total two peers agree on
- spread: context parallelism, which prompt tokens a CP rank holds and where in its cache
"""
