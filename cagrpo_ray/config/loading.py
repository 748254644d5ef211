"""YAML files, `--set` overrides and the errors users see, for the typed tree (`sections.py`)."""

from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from cagrpo_ray.config.checks import check_across_sections
from cagrpo_ray.config.sections import Config
from cagrpo_ray.errors import UserError


class ConfigError(UserError, ValueError):
    """A config key or value is wrong; the message names the key and what is allowed."""


def _section_at(path: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] | None = Config
    for part in path:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return None
        annotation = model.model_fields[part].annotation
        model = (
            annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel)
            else None
        )
    return model


def _describe(error: dict) -> str:
    loc = tuple(error["loc"])
    dotted = ".".join(str(p) for p in loc)
    given = error.get("input")
    if error["type"] == "extra_forbidden":
        parent = _section_at(loc[:-1])
        allowed = ", ".join(parent.model_fields) if parent else "?"
        return f"{dotted}: unknown key; allowed keys here: {allowed}"
    if error["type"] == "literal_error":
        field = _section_at(loc[:-1])
        choices = typing.get_args(field.model_fields[loc[-1]].annotation) if field else ()
        allowed = ", ".join(str(c) for c in choices) or error.get("ctx", {}).get("expected", "?")
        return f"{dotted}: {given!r} is not one of {allowed}"
    if error["type"] == "registry_name":  # a name no registry entry has
        return f"{dotted}: {error['msg']}"
    if error["type"] == "plugin":  # a section's plugin that cannot be imported
        return f"{dotted}.plugins: {error['msg']}"
    if error["type"] == "value_error" and isinstance(given, dict):
        # a section's own check (e.g. run.mode against run.max_staleness): its message names
        # the keys, the whole section would only be noise
        return f"{dotted}: {error['msg'].removeprefix('Value error, ')}"
    return f"{dotted}: {given!r} is invalid: {error['msg']}"


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> dict:
    """`["algorithm.lr=1e-6", ...]` -> nested dict; values are parsed as YAML scalars."""
    tree: dict = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected dotted.key=value")
        _set_dotted(tree, key.strip(), yaml.safe_load(raw))
    return tree


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def from_dict(tree: dict) -> Config:
    """Validate a nested dict; raises ConfigError listing every wrong key or value."""
    try:
        config = Config.model_validate(tree)
    except ValidationError as exc:
        lines = [_describe(e) for e in exc.errors()]
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines)) from None
    try:
        return check_across_sections(config)
    except ValueError as exc:
        raise ConfigError(f"invalid config:\n  {exc}") from None


def load_config(
    path: str | Path | list[str | Path] | None = None, overrides: list[str] | None = None
) -> Config:
    """Load YAML (or the defaults when path is None), apply `--set` overrides, validate.

    `path` may be a list of files: later files override earlier ones key by key (e.g. the
    async schedule of configs/async.yaml under a GPU recipe).
    """
    paths = [] if path is None else [path] if isinstance(path, str | Path) else list(path)
    tree: dict = {}
    for one in paths:
        layer = yaml.safe_load(Path(one).read_text()) or {}
        if not isinstance(layer, dict):
            raise ConfigError(f"{one}: the top level must be a mapping of sections")
        tree = _merge(tree, layer)
    tree = _merge(tree, parse_overrides(overrides or []))
    try:
        return from_dict(tree)
    except ConfigError as exc:
        where = f"{', '.join(map(str, paths))}: " if paths else ""
        raise ConfigError(f"{where}{exc}") from None


def to_yaml(config: Config) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def describe_fields(model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    """One line per field: dotted key, default and description, and the allowed values of a
    field that has a fixed set (the algorithm's registries among them), for `--describe`."""
    lines = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            lines += describe_fields(annotation, f"{prefix}{name}.")
            continue
        default = field.get_default(call_default_factory=True)
        line = f"{prefix}{name} = {default!r}  # {field.description}"
        registry = getattr(model, "registries", {}).get(name)
        if registry is not None:  # its names now, the plugins' included
            line += f" One of: {', '.join(registry)}."
        elif typing.get_origin(annotation) is typing.Literal:
            line += f" One of: {', '.join(map(str, typing.get_args(annotation)))}."
        lines.append(line)
    return lines


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        action="append",
        help="YAML config (only what differs from the defaults); repeat to layer files, later "
        "ones overriding earlier ones key by key.",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Override one field by dotted path, e.g. --set algorithm.lr=1e-6 (repeatable).",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cagrpo_ray.config", description="Print the resolved configuration."
    )
    add_config_args(parser)
    parser.add_argument(
        "--describe",
        action="store_true",
        help="List every field with its help (and, given a config, its plugins' names too).",
    )
    args = parser.parse_args(argv)
    if args.describe and not args.config and not args.overrides:
        print("\n".join(describe_fields()))
        return 0
    try:
        config = load_config(args.config, args.overrides)  # with its plugins' names
    except (ConfigError, OSError) as exc:
        print(exc, file=sys.stderr)
        return 2
    print(
        "\n".join(describe_fields()) if args.describe else to_yaml(config),
        end="\n" if args.describe else "",
    )
    return 0
