"""The command line over the simulator: ``growpage sim ...`` (``sim.py``) and ``growpage
calibrate`` (``calibrate.py``), their options in ``cli.py``.

A face (docs/architecture.md): it stands on ``growpage.executors`` (grids), which stand on the
simulator, and ``calibrate`` measures the engine too; nothing below it imports it.
"""
