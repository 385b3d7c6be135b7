"""geometry.registration: what a rank registers, its document both ways, its digests and the
faces checks read of it (imports ``leaves`` and ``tokens``; none of the checks).

Reading path:
- identity: model identity and KV quantization, what makes two ranks' bytes mean the same
- domains: topology domains, where a rank runs (they order pairs, never change a verdict)
- document: the registration document parsed, every type and bound checked
- rendering: a registration rendered back to its document
- digests: canonical JSON, the canonical and geometry digests
- faces: what the peer checks (``RankFace``, the class digest) and the instance checks (the
  instance digest) read of a rank
- model: ``RankRegistration``, the document made typed, with its derived geometry
- builder: a rank's views built from per-layer specs, as a worker describes its pools
"""
