"""Algorithm entries from a user's own files: `algorithm.plugins: [path/to/my_algo.py, pkg.mod]`.

A plugin is a Python file or an importable module that registers entries with the package's
decorators (`register_advantage_estimator`, `register_policy_loss`, `register_reward_shaping`,
`register_group_filter`, `register_token_mask`, `register_controller`); once it is imported, its
names are config values like the built-in ones. The config imports the plugins it names before
it checks any other key (`algorithm.py`), in the driver, and every learner rank imports
them again before it trains (`LearnerSettings.plugins`): a file is named by its absolute path,
so every process on the machine (or on a shared file system) finds the same one.

A plugin that cannot be imported, or whose registration is refused (a name already taken by
another definition, a function with the wrong signature: `registries.py`), raises `PluginError`
naming the plugin, before anything of the run starts. Each plugin is imported once per process.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from cagrpo_ray.imports import import_source

_loaded: dict[str, ModuleType] = {}  # resolved spec -> module, per process


class PluginError(ValueError):
    """A plugin that cannot be used: not importable, or a registration refused."""


def resolve(spec: str, base: str | Path | None = None) -> str:
    """`spec` as every process can import it: a `.py` file by its absolute path (relative ones
    against `base`, default the working directory), a module name as it is."""
    if spec.endswith(".py"):
        return str((Path(base or Path.cwd()) / spec).resolve())
    return spec


def load_plugins(specs, base: str | Path | None = None) -> list[ModuleType]:
    """Import every plugin of `specs` (once per process); their modules, in order."""
    modules = []
    for spec in specs:
        key = resolve(spec, base)
        if key not in _loaded:
            try:
                _loaded[key] = import_source(key, str(base or Path.cwd()))
            except Exception as error:
                raise PluginError(
                    f"plugin {spec!r} cannot be used: {type(error).__name__}: {error}"
                ) from error
        modules.append(_loaded[key])
    return modules
