"""The token inspector: which tokens CA-GRPO tames, step by step, in the browser.

`records.py` is what the learner writes every `metrics.inspect_every` steps (one Parquet file
per step, a row per response of `metrics.inspect_groups` whole prompt groups); `page.py`
renders a step as one offline HTML page; `server.py` serves a run's steps live; `cli.py` is
`python -m cagrpo_ray.inspect`.
"""

from cagrpo_ray.inspect.page import render_page
from cagrpo_ray.inspect.records import (
    INSPECT_SCHEMA,
    inspected_steps,
    read_step,
    records_from_arrays,
    select_groups,
    write_step,
)
from cagrpo_ray.inspect.server import InspectorServer

__all__ = [
    "INSPECT_SCHEMA",
    "InspectorServer",
    "inspected_steps",
    "read_step",
    "records_from_arrays",
    "render_page",
    "select_groups",
    "write_step",
]
