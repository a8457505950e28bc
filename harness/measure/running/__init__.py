"""Running one fix of a cell: the call and its checks (``fix_run``), a training step with its
mode's recipe (``training``), a short fit (``fitting``), the random draws and discrete choices
a cell is judged along (``replay``), the float64 run that keeps float64 where the code casts
narrower (``stays_float64``), the error a cell raised (``errors``) and the records of cells
with no outcome of their own (``crashes``).

May import: ``host``, ``precision``, ``tracing``, ``authoring``.
"""
