"""Sources of spans and utilization samples: OTLP receivers, span normalization, NVML and procfs samplers.

Everything here turns outside input into ``auditor.model`` records and hands them to the store
(spans through :class:`collectors.spanwriter.SpanWriter`, samples through a
:class:`collectors.sampling.SamplingLoop` sink). Nothing here reads the store back.
"""
