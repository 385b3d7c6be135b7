"""Transfer jobs: ``legs`` (request -> plans and opened pools), ``journal`` (job rows, written before
a job can run), ``service`` (the facade the REST layer calls). Importing this package imports the
data plane (torch); the app does so only when it starts its worker pool.
"""

from kvroute.control.transfers.service import ForeignJob, TransferService

__all__ = ["ForeignJob", "TransferService"]
