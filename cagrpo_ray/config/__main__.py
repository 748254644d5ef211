"""`python -m cagrpo_ray.config`: print the resolved configuration, or describe every field."""

from cagrpo_ray.config.loading import main

raise SystemExit(main())
