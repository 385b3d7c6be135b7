"""The API tests' registration documents: the shared factory in ``tests.documents``."""

from tests.documents import ELEMENT_BYTES, heads_per_rank, rank_document

__all__ = ["ELEMENT_BYTES", "heads_per_rank", "rank_document"]
