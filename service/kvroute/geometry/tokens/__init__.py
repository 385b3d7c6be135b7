"""geometry.tokens: token ranges, the periods they are cut from, and sliding windows (imports
``leaves`` only).

Reading path:
- ranges: token ranges, block lists and the bytes of listed blocks a range moves
- requests: a request's blocks on both sides, its token window and state slots (``RequestBlocks``)
- periods: one period of tokens that two sides with different block sizes or CP placements cut
  evenly (``PeriodMap``)
- window: which tokens a windowed view pair moves (a window restricts a range)
"""
