"""Correlation: joins kernel events, spans and samples by request and judges each one.

``traces`` assembles requests from spans, ``live`` holds what live notices say is running,
``verdict`` owns the verdict rules, ``waste`` prices the work, ``correlator`` runs the passes.
"""

from auditor.correlate.correlator import Correlator

__all__ = ["Correlator"]
