"""Connection events from the kernel: when a client closed (FIN) or reset (RST) its connection.

The daemon uses exactly this surface::

    src = open_source(ports=[8000], prefer="auto", host="gpu-host-1")
    src.start()
    events = src.poll(timeout_s=0.1)   # list[auditor.model.ConnEvent], ts_ns wall clock
    src.set_ports([8000, 8001])        # live, no reload
    src.lost_events()                  # cumulative
    src.stop()

and ``probes.writer.ConnEventWriter`` to store what it polls in batches.
"""

from __future__ import annotations

from probes.source import ConnEventSource, ProbeUnavailable, open_source

__all__ = ["ConnEventSource", "ProbeUnavailable", "open_source"]
