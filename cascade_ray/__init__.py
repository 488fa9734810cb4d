"""cascade-ray: train a model in stages on Ray, each stage frozen and handed to the next.

Public entry points: :func:`cascade_ray.api.run_pipeline` and
:func:`cascade_ray.api.load_config` (with :class:`cascade_ray.api.RunOptions`); the ``cascade-ray``
CLI and ``pipelines/three_stage.py`` wrap both.
"""

__version__ = "0.1.0"
