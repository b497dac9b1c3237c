"""The surgery commands end to end: ``run`` (a recipe to its command), ``convert``, ``compress`` and ``steps`` (what
they share: loading, calibration, scoring, the final write)."""
