"""geometry.plans: who sends which bytes where (imports every layer below).

Reading path:
- mappers: byte fragments of one matched view pair, relative to each side's slot
- reading: strict readers for plan documents
- rows: where every moved token of a pair lives on each side (``TokenAxis``), periods cut from it
- plan_pairs: a plan's view and state transfers, and their JSON both ways
- plan: ``Plan`` and ``PeerPlan``, plans as data
- topology: which sender ranks a receiver hears from, and which of them writes each byte
- state_planner: one receiver state view, which sender rank writes which bytes
- bounce: the fan-in bounce gate (rule 6)
- planner: ``build_plan``, one sender instance to one receiver rank
"""
