"""Full validation: YAML -> overrides -> schema -> cross-field rules -> shape preflight.

Validation runs in three passes and collects the issues before raising once:

1. the schema (unknown keys, wrong types, ranges), translated into key paths with a
   did-you-mean (:func:`cascade_ray.config.loader.parse_config`);
2. the offending keys are dropped (defaults take their place) so that the rest of
   the file can still be checked: cross-field rules (:mod:`.semantic`);
3. the meta-device shape preflight of the whole chain (:mod:`cascade_ray.models.plan`),
   only when passes 1 and 2 found nothing: running modules on the meta device imports
   torch's compiler stack (~1.5 s), and a file already refused is answered without it.

So a file with a typo'd optimizer, a string ``betas`` and an unknown key yields one error
with three entries and a note that the shapes come next. This sits above models and solver because passes 2 and 3
build modules and optimizers; the schema pass itself is in ``config/``.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

from cascade_ray.config.loader import parse_config, sorted_issues
from cascade_ray.config.schema import PipelineConfig
from cascade_ray.config.trust import module_refusal
from cascade_ray.config.yaml_io import apply_overrides, read_yaml
from cascade_ray.errors import ConfigError, ConfigIssue


def load_config(
    path: str | Path,
    overrides: typing.Sequence[str] = (),
    *,
    preflight: bool = True,
    trust: typing.Sequence[str] = (),
) -> PipelineConfig:
    """Read a YAML config, apply ``key=value`` overrides and validate everything.

    Args:
        path: the YAML file.
        overrides: ``key=value`` items.
        preflight: also run the meta-device shape preflight.
        trust: ``--trust`` modules, added to the config's ``trusted_modules`` (so a run's
            saved ``config.yaml`` carries them).

    Raises:
        ConfigError: listing every problem found, each with its key path.
    """
    raw = read_yaml(path)
    issues = apply_overrides(raw, list(overrides))
    issues += add_trust(raw, trust)
    return validate_config(raw, source=str(path), preflight=preflight, issues=issues)


def add_trust(raw: dict[str, Any], trust: typing.Sequence[str], key: str = "--trust") -> list[ConfigIssue]:
    """Add the `trust` module names to ``raw["trusted_modules"]``; the issues of names that cannot be trusted.

    A refused name (the standard library, not a dotted name) is reported under `key` and not added.
    """
    issues, good = [], []
    for name in trust:
        problem = module_refusal(name)
        if problem is None:
            good.append(name)
        else:
            issues.append(ConfigIssue(key, problem, f"drop {key} {str(name)[:80]}; trust only your own packages"))
    listed = raw.get("trusted_modules", [])
    if good and isinstance(listed, list):  # anything else is the schema pass's to report
        raw["trusted_modules"] = [*listed, *(n for n in good if n not in listed)]
    return issues


def validate_config(
    raw: dict[str, Any],
    *,
    source: str = "",
    preflight: bool = True,
    issues: list[ConfigIssue] | None = None,
) -> PipelineConfig:
    """Validate a raw mapping (from YAML, overrides or a Tune-sampled dict).

    Raises:
        ConfigError: listing every problem found.
    """
    issues = list(issues or [])
    note = ""
    cfg, dropped_paths = parse_config(raw, issues)
    if cfg is not None:
        # imported here, not at the top: they import torch, which a mistake found by the YAML
        # reader or the overrides (read_yaml, apply_overrides) never needs
        from cascade_ray.checks.semantic import semantic_issues
        from cascade_ray.models.plan import model_spec_issues, pretrained_issues, shape_issues

        issues += [i for i in semantic_issues(cfg) + model_spec_issues(cfg) if i.path not in dropped_paths]
        if preflight and not issues:  # modules built on meta, not run: cheap
            issues += pretrained_issues(cfg)
        # Running the chain on the meta device costs torch's compiler stack (~1.5 s) on top of
        # torch's import: a file already refused is answered without it (a mistake in well under
        # the time a good file takes), and the message says the shapes are checked once the
        # problems listed are fixed.
        if preflight and issues:
            note = "the shapes of the chain are checked once the problems above are fixed"
        elif preflight:
            issues += shape_issues(cfg)
    if issues:
        raise ConfigError(sorted_issues(issues), source, note=note)
    if cfg is None:  # a failed parse always records an issue; this is a bug if reached
        raise RuntimeError("config parse failed without reporting an issue")
    return cfg
