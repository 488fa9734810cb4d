"""cascade-ray: train a model in stages on Ray, each stage frozen and handed to the next.

Public entry points: :func:`cascade_ray.api.run_pipeline` and
:func:`cascade_ray.config.load_config`; the ``cascade-ray`` CLI wraps both.
"""

__version__ = "0.1.0"
