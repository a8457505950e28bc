"""The case API: ``Case``, ``fix`` and the workload (``case``), the registry and its contract
check (``registry``), a user's model as a case (``model_case``), the default loss
(``losses``), and a user's module imported first in a forked child (``import_probe``).

May import: ``host``, ``precision``, ``tracing``.
"""
