"""Step-time and capacity-boundary measurements of the local engine (``growpage calibrate``)."""
