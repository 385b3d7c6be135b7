"""geometry.checks: the checks of docs/geometry.md "Rejected at the boundary", in their order
(imports ``leaves``, ``tokens`` and ``registration``).

Reading path:
- validate: a document's own consistency (self checks)
- instance: every rank of an instance agrees with its layout; the caller's memo of agreeing faces
- matching: which view of a peer a view pairs with
- pairs: the geometry of one matched view pair (mapper, byte units, its window)
- state: recurrent state (Mamba2 SSM and conv) between peers
- compat: the peer stages and the full registration check, in order
- classes: admission against one representative per peer geometry class, verdicts memoized
"""
