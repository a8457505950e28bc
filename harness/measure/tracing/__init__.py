"""The dtype trail: the tracer (``trail``), what counts as compute and its FLOPs (``kernels``),
where in the source (``source_sites``), autocast as Python sets it (``python_watch``), the
core dtypes a fix computed in (``observe``, ``dispatch_mode``), and where a backward failed
(``backward_sites``).

May import: ``host``, ``precision``.
"""
