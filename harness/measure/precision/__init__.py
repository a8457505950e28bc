"""Putting a cell's precision on a workload, and checking that it took: dtype names
(``dtypes``), the mode applied to one run (``modes``), casting models and inputs
(``casting``), a fix's output as named leaves (``outputs``) and the flags of a precision
that was not applied (``flags``).

May import: no other part of ``harness.measure``.
"""
