"""Full config validation: the schema, cross-field rules and the shape preflight, one error.

Above models and solver (the checks build modules on the meta device and probe optimizer
signatures); below the stage runtime, which re-validates every config it receives.
"""

from cascade_ray.checks.validate import load_config, validate_config

__all__ = ["load_config", "validate_config"]
