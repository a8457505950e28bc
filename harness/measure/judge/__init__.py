"""Judging a cell against float64: the shared reference and yardsticks (``references``,
``rounding``), the tolerance rule (``numerics``), and the verdict (``judging``).

May import: ``host``, ``precision``, ``tracing``, ``authoring``, ``running``.
"""
