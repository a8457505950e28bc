"""Timing and figures: the sampler (``timing``), a column's cells timed (``cell_timing``),
throughput and memory (``perf``), and this machine's measured peaks (``peaks``).

May import: ``host``, ``precision``, ``tracing``, ``authoring``, ``running``.
"""
